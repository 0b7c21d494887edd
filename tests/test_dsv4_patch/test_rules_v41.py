"""DeepSeek-V4.1 in the pure rules, checked against the real vLLM code.

Where vLLM's code runs without a GPU it is called: the V4.1 resolver, the indexer
row width, the attention-class selector, the backends' block sizes (the platform's
capability patched), and the real ``MLAAttentionSpec`` / ``SlidingWindowMLASpec`` /
``CircularBufferSpec`` page sizes built the way ``deepseek_v41/attention.py`` builds
them. The record constants are read out of the installed file and the vLLM 0.33.0
wheel (tests/releases/sources.py's cache), never retyped here.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dsv4_patch import rules
from dsv4_patch.rules.dtypes import resolve_kv_cache_dtype
from dsv4_patch.rules.family import default_block_size, is_mxfp8_node, resolve_v41_kv_cache_dtype
from dsv4_patch.rules.v41_backend import v41_attention
from tests.support.rule_contracts import is_nested
from tests.support.v41_pages import V41_FLASH, real_spec

ATTN = "vllm/models/deepseek_v41/attention.py"
V4_ATTN = "vllm/models/deepseek_v4/attention.py"
SM90, SM100, SM120 = (9, 0), (10, 0), (12, 0)
DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla", "nvfp4_ds_mla", "bfloat16")


def installed_source(path: str) -> str:
    import vllm

    return (Path(vllm.__file__).parent.parent / path).read_text()


def wheel_source(path: str) -> str:
    from tests.releases import sources as release_sources

    try:
        return release_sources.source("0.33.0", path)
    except Exception as exc:  # no cached wheel and no way to download it: say so
        pytest.skip(f"vLLM 0.33.0 wheel unavailable: {exc}")


SOURCES = {"0.32.0": lambda p: installed_source(p), "0.33.0": lambda p: wheel_source(p)}


def constants(text: str) -> dict[str, int]:
    """The record constants as ``DeepseekV4Attention.__init__`` of deepseek_v41 writes them."""
    pick = {
        "swa": r"self\.swa_bytes_per_token = (\d+) if self\.kv_mxfp8 else (\d+)",
        "nvfp4": r"(\d+) if self\.kv_cache_dtype == \"nvfp4_ds_mla\"",
        "align": r"self\.kv_page_alignment = (\d+) if self\.kv_mxfp8 else (\d+)",
        "swa_block": r"DeepseekV4SWACache\([^)]*?block_size=(\d+)",
        "indexer_align": r"(\d+) if uses_fp8_ds_mla_layout and not _use_v41_mxfp8_kv_record\(\)"
                         r" else (\d+)",
    }
    out: dict[str, int] = {}
    for key, pattern in pick.items():
        match = re.search(pattern, text, re.S)
        assert match, f"{key}: pattern {pattern!r} no longer in deepseek_v41/attention.py"
        for i, value in enumerate(match.groups()):
            out[f"{key}{i}"] = int(value)
    return out


@pytest.mark.parametrize("version", sorted(SOURCES))
def test_record_constants_are_the_ones_in_vllm(version: str) -> None:
    c = constants(SOURCES[version](ATTN))
    assert (c["swa0"], c["swa1"]) == (rules.family.V41_MXFP8_RECORD, rules.family.V4_RECORD)
    assert c["nvfp40"] == rules.family.NVFP4_RECORD
    assert (c["align0"], c["align1"]) == (rules.family.V41_MXFP8_ALIGNMENT,
                                          rules.family.V4_ALIGNMENT)
    assert c["swa_block0"] == rules.family.SWA_BLOCK
    assert (c["indexer_align0"], c["indexer_align1"]) == (rules.family.V4_ALIGNMENT,
                                                          rules.family.ROW_ALIGNMENT)


@pytest.mark.parametrize("version", sorted(SOURCES))
def test_v4_keeps_one_record_on_every_gpu(version: str) -> None:
    """V4 (not V4.1) has no per-GPU record: SM90 and SM100 FlashMLA pools agree byte for byte."""
    text = SOURCES[version](V4_ATTN)
    assert "is_device_capability_family" not in text and "528" not in text
    assert "state_content_bytes=584 if uses_fp8_ds_mla_layout" in text
    assert "alignment=576 if uses_fp8_ds_mla_layout else 512" in text


# ------------------------------------------------------------------ the real resolver


def _real_resolver(version: str) -> Any:
    if version == "0.32.0":
        from vllm.models.deepseek_v41.attention import _resolve_dsv4_kv_cache_dtype

        return _resolve_dsv4_kv_cache_dtype
    from tests.releases import sources as rs

    text = wheel_source(ATTN)
    import ast

    node = rs._find(ast.parse(text), ast.FunctionDef, "_resolve_dsv4_kv_cache_dtype")
    assert node is not None, "vLLM 0.33.0 has no _resolve_dsv4_kv_cache_dtype"
    body = rs.HEADER + "CacheConfig = object\n\n" + rs._segment(text, node)
    return rs._load("dsv4_release_v41_resolver_v0_33_0", body, 0)._resolve_dsv4_kv_cache_dtype


@pytest.mark.parametrize("version", sorted(SOURCES))
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("preferred", rules.PACKED_DTYPES)
def test_v41_resolver_matches_vllm(version: str, packed: bool, preferred: str) -> None:
    real = _real_resolver(version)
    for dtype in DTYPES:
        try:
            want: Any = real(packed, dtype, None, preferred)
            want = (want[0], str(want[1]).removeprefix("torch."))
        except ValueError:
            want = ValueError
        try:
            # mxfp8=True: the nvfp4-on-SM90 refusal is the layer's, not the resolver's
            got: Any = resolve_v41_kv_cache_dtype(packed, dtype, preferred, True)
        except rules.KVCacheDtypeError:
            got = ValueError
        assert got == want, (version, packed, preferred, dtype)


def test_v41_refuses_the_fp8_aliases_v4_accepts_with_upstreams_words_first() -> None:
    for dtype in ("fp8_e4m3", "fp8_e5m2", "bfloat16"):
        with pytest.raises(rules.KVCacheDtypeError) as err:
            rules.v41_record("cuda", SM90, None, dtype)
        assert str(err.value).startswith(
            f"DeepseekV4 packed KV layouts only support fp8 kv-cache, got {dtype}")
        assert "Fix:" in str(err.value)
        assert resolve_kv_cache_dtype(rules.Layout.FP8_DS_MLA, "fp8_e4m3").storage \
            is rules.Storage.FP8_DS_MLA or dtype != "fp8_e4m3"
    with pytest.raises(rules.KVCacheDtypeError, match="only on SM100"):
        rules.v41_record("cuda", SM90, None, "nvfp4_ds_mla")


# ------------------------------------------------------------------ per-GPU choices


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set the capability vLLM's platform reports (family checks and the selector read it)."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    def set_capability(cap: tuple[int, int]) -> None:
        cls = type(current_platform)
        monkeypatch.setattr(cls, "get_device_capability",
                            classmethod(lambda c, device_id=0: DeviceCapability(*cap)))
        monkeypatch.setattr(cls, "is_device_capability_family",
                            classmethod(lambda c, fam, device_id=0: cap[0] == fam // 10))
    return set_capability


@pytest.mark.parametrize("cap", [SM90, SM100, SM120])
def test_record_choice_and_block_size_are_vllms(platform: Any, cap: tuple[int, int]) -> None:
    from vllm.models.deepseek_v41.attention import (
        _indexer_k_cache_head_dim,
        _use_v41_mxfp8_kv_record,
    )
    from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLABackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV41IndexerBackend

    platform(cap)
    assert _use_v41_mxfp8_kv_record() is is_mxfp8_node("cuda", cap)
    block = default_block_size(rules.Family.V41, "cuda", cap)
    assert DeepseekV4FlashMLABackend.get_supported_kernel_block_sizes() == [block]
    assert DeepseekV41IndexerBackend.get_supported_kernel_block_sizes() == [block]
    assert _indexer_k_cache_head_dim(128, False) == rules.family.INDEXER_FP8_ROW
    assert _indexer_k_cache_head_dim(128, True) == rules.family.INDEXER_MXFP4_ROW


@pytest.mark.parametrize(("cap", "backend", "mega"), [
    (SM90, None, False), (SM100, None, True), (SM100, None, False), (SM120, None, False),
    (SM100, "FLASHMLA_SPARSE_DSV41", True), (SM100, "FLASHINFER_MLA_SPARSE_DSV41", True),
    (SM120, "FLASHINFER_MLA_SPARSE_DSV41", False), (SM100, "FLASHMLA_MEGA_ATTN_DSV41", True),
    (SM90, "FLASHMLA_SPARSE", False)])
def test_attention_choice_is_vllms_selector(platform: Any, monkeypatch: pytest.MonkeyPatch,
                                            cap: tuple[int, int], backend: str | None,
                                            mega: bool) -> None:
    from vllm.models.deepseek_v41.nvidia import model
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    platform(cap)
    monkeypatch.setattr(model.DeepseekV4MegaAttnAttention, "is_available_for",
                        classmethod(lambda cls, cfg: mega and cap[0] == 10))
    cfg = SimpleNamespace(
        attention_config=SimpleNamespace(
            backend=AttentionBackendEnum[backend] if backend else None),
        parallel_config=SimpleNamespace(prefill_context_parallel_size=1))
    cls = model._select_dsv4_attn_cls(cfg)
    ours = v41_attention(rules.EngineSetup("0.32.0", "cuda", cap, attention_backend=backend),
                               fits=mega)
    packed = cls.use_fp8_ds_mla_layout
    preferred = cls.packed_kv_cache_dtype.fget(None)
    assert (ours.packed, ours.preferred if ours.packed else preferred) == (packed, preferred)


def test_no_cpu_path_for_v41() -> None:
    with pytest.raises(rules.LayoutError, match=r"no DeepSeek-V4\.1 path"):
        rules.v41_record("cpu", None, None, "auto")


# ------------------------------------------------------------------ caches per layer


NODES = [("cuda", SM90, None, "auto"), ("cuda", SM100, None, "auto"),
         ("cuda", SM100, "FLASHMLA_SPARSE_DSV41", "fp8"), ("cuda", SM120, None, "auto"),
         ("cuda", SM100, "FLASHINFER_MLA_SPARSE_DSV41", "auto"),
         ("cuda", SM100, "FLASHINFER_MLA_SPARSE_DSV41", "fp8"), ("rocm", None, None, "auto")]


@pytest.mark.parametrize("node", NODES, ids=lambda n: f"{n[0]}-{n[1]}-{n[2]}-{n[3]}")
def test_every_cache_page_is_what_vllms_spec_computes(node: tuple[Any, ...]) -> None:
    topo = rules.V41Topology.from_hf_config(V41_FLASH)
    record = rules.v41_record(*node)
    caches = rules.v41_caches(topo, record, dspark=True)
    for cache in caches:
        assert cache.page_size_bytes == real_spec(cache, record, topo.head_dim), cache


def test_caches_follow_the_topology() -> None:
    topo = rules.V41Topology.from_hf_config(V41_FLASH)
    caches = rules.v41_caches(topo, rules.v41_record("cuda", SM90, None, "auto"), dspark=True)
    by_role: dict[str, list[int]] = {}
    for c in caches:
        by_role.setdefault(c.role, []).append(c.index)
    assert by_role["swa"] == list(range(43))  # 40 layers + 3 DSpark draft layers
    assert by_role["main"] == [2, 8, 14, 20]  # kv_source_layer_ids only
    assert by_role["indexer"] == [2, 8, 14, 20]  # index AND kv sources
    assert by_role["compressor_state"] == [2, 8, 14]  # ratio-2 sources
    ring = next(c for c in caches if c.role == "compressor_state")
    assert ring.block_size == 8
    spec = rules.v41_caches(topo, rules.v41_record("cuda", SM90, None, "auto"),
                            num_speculative_tokens=7)
    assert next(c for c in spec if c.role == "compressor_state").block_size == 16


@pytest.mark.parametrize(("node", "per_token"), [
    (("cuda", SM90, None, "auto"), 1827), (("cuda", SM100, "FLASHMLA_SPARSE_DSV41", "auto"), 1656),
    (("cuda", SM100, None, "auto"), 1056), (("cuda", SM100, None, "fp8_ds_mla"), 1656)])
def test_v41_flash_growth_per_token(node: tuple[Any, ...], per_token: int) -> None:
    """The issue's rough figures, exactly (pages padded, default block sizes)."""
    topo = rules.V41Topology.from_hf_config(V41_FLASH)
    assert rules.v41_bytes_per_token(rules.v41_caches(topo, rules.v41_record(*node))) == per_token


def test_family_of_configs() -> None:
    assert rules.family_of(V41_FLASH) is rules.Family.V41
    assert rules.family_of({"architectures": ["DSparkV41DraftModel"]}) is rules.Family.V41
    assert rules.family_of({"architectures": ["DeepseekV4ForCausalLM"]}) is rules.Family.V4
    assert rules.family_of({"architectures": ["LlamaForCausalLM"]}) is None
    # The shipped copy is in the published nested layout; its flat form plans the same.
    assert is_nested(V41_FLASH)
    flat = rules.flatten_config(V41_FLASH)
    assert not is_nested(flat) and "vision_config" not in flat
    assert rules.V41Topology.from_hf_config(flat) == rules.V41Topology.from_hf_config(V41_FLASH)
