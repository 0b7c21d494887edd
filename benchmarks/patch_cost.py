"""Benchmark: what the dsv4_patch plugin costs.

1. ``register()`` time in a fresh interpreter that already imported vLLM (the cost
   every vLLM process pays), and whether it imported any DeepSeek-V4 module.
2. Engine boot of a tiny non-DeepSeek model (Llama-shaped, random weights) with the
   plugin disabled (``VLLM_PLUGINS=""``) and enabled, alternated, same machine, one
   run: the ratio is the plugin's cost for users who do not serve DeepSeek-V4.
3. Engine boot of the tiny DeepSeek-V4 with the plugin (with the plugin disabled it
   cannot boot here: see docs/benchmarks.md).

Prints a table and writes JSON (``--out``). Run: ``python -m benchmarks.patch_cost``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.results import write_result
from dsv4_patch.tiny_model import CPU_ENGINE_ENV as CPU_ENV

REPO = Path(__file__).resolve().parents[1]

REGISTER_PROBE = """
import json, sys, time
import vllm  # noqa: F401  (every vLLM process has this before plugins load)
from vllm.platforms import current_platform
current_platform.device_type
t0 = time.perf_counter()
from dsv4_patch import plugin
rec = plugin.register()
dt = time.perf_counter() - t0
dsv4 = sorted(m for m in sys.modules if m.startswith("vllm.models.deepseek_v4"))
print("RESULT", json.dumps({"register_ms": dt * 1e3, "dsv4_modules": dsv4,
      "statuses": {r.name: r.status for r in rec.results}}))
"""

BOOT_PROBE = """
import json, os, sys, time
from vllm import LLM
t0 = time.monotonic()
llm = LLM(model=sys.argv[1], load_format="dummy", enforce_eager=True, max_model_len=1024,
          max_num_seqs=4)
boot = time.monotonic() - t0
out = llm.generate(["hello world"], __import__("vllm").SamplingParams(max_tokens=4))
print("RESULT", json.dumps({"boot_s": boot, "tokens": len(out[0].outputs[0].token_ids)}))
sys.stdout.flush()
llm.llm_engine.engine_core.shutdown(timeout=30)  # else the engine core outlives os._exit
os._exit(0)
"""


def tiny_llama(dsv4_dir: Path) -> Path:
    """A Llama-shaped random-weight model sharing the tiny DSv4 tokenizer."""
    out = dsv4_dir.parent / "tiny-llama"
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((dsv4_dir / "config.json").read_text())["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (dsv4_dir / name).exists():
            shutil.copy(dsv4_dir / name, out / name)
    return out


def _run(code: str, args: list[str], plugins: str | None, timeout: float) -> dict[str, Any]:
    env = {**os.environ, **CPU_ENV}
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(
        f"probe failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "patch_cost.json")
    args = parser.parse_args()
    from dsv4_patch.tiny_model import ensure_tiny_model

    dsv4 = ensure_tiny_model()
    llama = tiny_llama(dsv4)
    register = [_run(REGISTER_PROBE, [], None, 300) for _ in range(args.repeats)]
    boots: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.repeats):  # alternate so drift hits both arms alike
        for arm, plugins in (("off", ""), ("on", None)):
            boots[arm].append(_run(BOOT_PROBE, [str(llama)], plugins, 900)["boot_s"])
    dsv4_boot = [_run(BOOT_PROBE, [str(dsv4)], None, 900)["boot_s"] for _ in range(args.repeats)]
    result = {
        "register_ms_median": statistics.median(r["register_ms"] for r in register),
        "register_imported_dsv4_modules": register[0]["dsv4_modules"],
        "register_statuses": register[0]["statuses"],
        "llama_boot_s": boots,
        "llama_boot_ratio_on_over_off": statistics.median(boots["on"])
        / statistics.median(boots["off"]),
        "dsv4_boot_s_with_plugin": dsv4_boot,
        "repeats": args.repeats,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{'measure':44} {'value':>12}")
    print(f"{'plugin register() (median ms)':44} {result['register_ms_median']:12.2f}")
    imported = len(result["register_imported_dsv4_modules"])
    print(f"{'DSv4 modules imported by register()':44} {imported:12d}")
    print(f"{'tiny Llama boot, plugin off (median s)':44} {statistics.median(boots['off']):12.2f}")
    print(f"{'tiny Llama boot, plugin on (median s)':44} {statistics.median(boots['on']):12.2f}")
    print(f"{'ratio on/off':44} {result['llama_boot_ratio_on_over_off']:12.3f}")
    print(f"{'tiny DSv4 boot, plugin on (median s)':44} {statistics.median(dsv4_boot):12.2f}")
    print(f"wrote {args.out}")
    print(f"wrote {write_table(args.repeats, result, boots, dsv4_boot)}")
    return 0


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({', '.join(f'{v:.1f}' for v in values)})"


def write_table(repeats: int, result: dict[str, Any], boots: dict[str, list[float]],
                dsv4_boot: list[float]) -> Path:
    """``benchmarks/results/patch_cost_s3.json``: the table docs/benchmarks.md shows."""
    return write_result(
        "patch_cost_s3", title="3. Patch cost",
        what=("What the dsv4_patch plugin costs: register() in a fresh process that imported "
              "vLLM, and engine boots with the plugin off and on, alternated; medians of "
              f"{repeats}."),
        command=f"flock /tmp/dsv4-heavy.lock timeout 900 python -m benchmarks.patch_cost "
                f"--repeats {repeats}",
        inputs={"repeats": repeats}, columns=["measure", "value"],
        rows=[
            ["plugin `register()` in a fresh process that imported vLLM (median ms)",
             f"{result['register_ms_median']:.1f}"],
            ["DeepSeek-V4 modules imported by `register()`",
             str(len(result["register_imported_dsv4_modules"]))],
            ["tiny Llama engine boot, plugin off (`VLLM_PLUGINS=\"\"`) (s)",
             _spread(boots["off"])],
            ["tiny Llama engine boot, plugin on (s)", _spread(boots["on"])],
            ["ratio on/off", f"{result['llama_boot_ratio_on_over_off']:.3f}"],
            ["tiny DeepSeek-V4 engine boot, plugin on (s)", _spread(dsv4_boot)],
        ])


if __name__ == "__main__":
    sys.exit(main())
