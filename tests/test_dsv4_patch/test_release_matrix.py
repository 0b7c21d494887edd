"""Source-level release matrix: the plugin's patches on the real code of every release.

For each released wheel 0.20.0-0.33.0 (``tests/releases/sources.py`` downloads each once
and cuts the decision code out of it), these tests run that release's own resolver /
layer dtype block / SM120 validator, stock and with the plugin's ``Patch.apply``.

Proves: what each release decides for every input of ``rules.PROBE_DTYPES`` on both
layouts, that ``rules.upstream_resolver_decision`` *is* the real 0.30-0.33 code, and that
with the plugin every release decides exactly like it (result string, torch dtype,
``cache_config`` write-back, error or not), also under ``python -O``; that no probe
raises on any release. Cannot prove: that a release's imports, the rest of the layer
``__init__`` or a forward pass work (tests/test_dsv4_patch/test_release_import.py and the end-to-end
checks do), nor anything about CUDA kernels.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from dsv4_patch import rules
from dsv4_patch.patches.kv_dtype import call_resolver, resolver_mismatches
from dsv4_patch.patches.sm120 import SM120_PATCH
from dsv4_patch.rules.dtypes import resolve_kv_cache_dtype
from tests.releases import sources as rs

ASSERTING = tuple(v for v in rs.RELEASES if v not in rs.FIXED_RELEASES)
LAYER_RELEASES = ("0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1")


@pytest.fixture(scope="module", autouse=True)
def wheels() -> None:
    """Every wheel in the cache first (4 downloads at a time on a fresh machine)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(rs.wheel, rs.RELEASES))


@pytest.mark.parametrize("version", rs.FIXED_RELEASES)
def test_upstream_oracle_is_the_real_fixed_resolver(version: str) -> None:
    """rules.upstream_resolver_decision equals the real 0.30-0.33 resolver on every input,
    both layouts (so it may serve as the oracle for the older releases)."""
    stock = rs.release(version, plugin=False)
    assert stock.kind == "resolver"
    assert resolver_mismatches(stock.resolver(), (True, False)) == []
    outcome = call_resolver(stock.resolver(), True, "fp8_e5m2")  # upstream accepts
    assert (outcome.cache_dtype_str, outcome.cache_config_after) == ("fp8_ds_mla", "fp8_ds_mla")


@pytest.mark.parametrize("version", ASSERTING)
def test_stock_release_fails_auto_with_the_upstream_assertion(version: str) -> None:
    """The bug, on each release's own code: ``auto`` on fp8_ds_mla raises AssertionError."""
    stock = rs.release(version, plugin=False)
    assert stock.kind == ("layer" if version in LAYER_RELEASES else "resolver")
    outcome = call_resolver(stock.resolver(), True, "auto")
    assert outcome.error is not None and outcome.error.startswith("AssertionError")
    # Everything else the asserting releases decide like upstream already.
    assert [m.split(":")[0] for m in resolver_mismatches(stock.resolver(),
                                                                  stock.layouts)] == ["'auto'"]


@pytest.mark.parametrize("optimize", [0, 1], ids=["asserts", "python-O"])
@pytest.mark.parametrize("version", rs.RELEASES)
def test_plugin_decides_like_upstream(version: str, optimize: int) -> None:
    """With the plugin, every release decides like the fixed upstream resolver on every
    input, both layouts where the release has both; under ``python -O`` too (the asserts
    are compiled out of the release's code, as they would be in that process)."""
    patched = rs.release(version, plugin=True, optimize=optimize)
    assert patched.patch is not None
    expected = "skipped" if version in rs.FIXED_RELEASES else "applied"
    assert patched.patch.status == expected, patched.patch
    assert resolver_mismatches(patched.resolver(), patched.layouts) == []


@pytest.mark.parametrize("version", ASSERTING)
def test_python_O_stock_accepts_what_upstream_refuses(version: str) -> None:
    """Why the probes compare every input: under -O the stock releases pass ``auto``
    (0.23+) or keep it unconverted (0.20-0.22), and take ``bfloat16`` silently."""
    stock = rs.release(version, plugin=False, optimize=1)
    outcome = call_resolver(stock.resolver(), True, "bfloat16")
    assert outcome.error is None
    assert "'bfloat16'" in " ".join(resolver_mismatches(stock.resolver()))


@pytest.mark.parametrize("version", rs.RELEASES)
def test_sm120_probe_never_raises_and_fixes_auto(version: str) -> None:
    """The SM120 validator patch on each release's own validator: 0.20-0.22 have none,
    0.23.0 inherits the generic 8-parameter one (left alone: it accepts everything, and
    calling it with 9 arguments was the 0.23.0 import crash), 0.24+ reject ``auto`` on
    SM12x until patched, then pass the dtype check; SM10x answers are unchanged."""
    import torch
    from vllm.platforms.interface import DeviceCapability

    module = rs.sm120_module(version)
    if module is None:
        assert version in LAYER_RELEASES
        return
    backend = module.DeepseekV4FlashInferMLASparseBackend
    args = (512, torch.bfloat16, "auto", 256, True, True, True)
    own = "supports_combination" in vars(backend)
    full = (*args, False) if own else args  # 0.23.0's base has no use_mm_prefix
    sm100 = backend.supports_combination(*full, DeviceCapability(10, 0))
    assert (backend.supports_combination(*full, DeviceCapability(12, 0)) is None) is (not own)
    result = SM120_PATCH.apply(module)
    assert result.status == ("applied" if own else "skipped"), result
    verdict = backend.supports_combination(*full, DeviceCapability(12, 0))
    assert verdict is None or "kv_cache_dtype" not in verdict
    assert backend.supports_combination(*full, DeviceCapability(10, 0)) == sm100
    bf16 = (512, torch.bfloat16, "bfloat16", *full[3:])
    if own:
        assert backend.supports_combination(*bf16, DeviceCapability(12, 0)) == (
            "kv_cache_dtype not supported")


@pytest.mark.parametrize("version", LAYER_RELEASES)
def test_layer_patch_refuses_before_the_assert(version: str) -> None:
    """0.20-0.22: with the plugin, a refused dtype raises our error (naming the fix)
    before the release's assert, and nothing is written to cache_config."""
    from types import SimpleNamespace

    patched = rs.release(version, plugin=True)
    config = SimpleNamespace(cache_dtype="bfloat16")
    with pytest.raises(rules.KVCacheDtypeError, match="kv_cache_dtype: auto \\(or fp8\\)"):
        patched.module.DeepseekV4MLAAttention(cache_config=config)
    assert config.cache_dtype == "bfloat16"
    config = SimpleNamespace(cache_dtype="auto")
    layer = patched.module.DeepseekV4MLAAttention(cache_config=config)
    assert (layer.kv_cache_dtype, config.cache_dtype) == ("fp8_ds_mla", "fp8_ds_mla")


def test_python_O_process_runs_the_same_matrix() -> None:
    """A real ``python -O`` interpreter (dsv4_patch's own code optimized too): the plugin
    still makes an asserting resolver release and a layer release decide like upstream."""
    code = (
        "import sys\nif sys.flags.optimize != 1: raise SystemExit(2)\n"
        "from dsv4_patch.patches.kv_dtype import resolver_mismatches\n"
        "from tests.releases import sources as rs\n"
        "for v in ('0.22.1', '0.29.0'):\n"
        "    r = rs.release(v, plugin=True)\n"
        "    bad = resolver_mismatches(r.resolver(), r.layouts)\n"
        "    print(v, r.patch.status, bad)\n"
        "    if r.patch.status != 'applied' or bad: raise SystemExit(1)\n"
    )
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("version", rs.RELEASES)
def test_plan_and_doctor_say_what_the_release_does(version: str) -> None:
    """``rules.stock_vllm_crashes_on`` is what ``plan`` warns about (stock-vllm-crash) and
    ``doctor`` prints ("stock vLLM of this version crashes"): it must equal what the
    release's own code does with ``auto`` on fp8_ds_mla, the table's "stock auto" column;
    and ``resolve_kv_cache_dtype`` (the replica's and the planner's decision) must
    store what the release with the plugin stores, for every string input."""
    stock = rs.release(version, plugin=False)
    outcome = call_resolver(stock.resolver(), True, "auto")
    assert rules.stock_vllm_crashes_on(version, rules.Layout.FP8_DS_MLA, "auto") is (
        outcome.error is not None and outcome.error.startswith("AssertionError"))
    patched = rs.release(version, plugin=True)
    for value in (v for v in rules.PROBE_DTYPES if isinstance(v, str)):
        engine = value.strip().lower()
        got = call_resolver(patched.resolver(), True, engine)
        try:
            res = resolve_kv_cache_dtype(rules.Layout.FP8_DS_MLA, value)
        except rules.KVCacheDtypeError:
            assert got.error is not None, (value, got)
            continue
        assert got.error is None and got.cache_dtype_str == res.cache_dtype_str, (value, got)
