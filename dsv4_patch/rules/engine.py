"""The one answer: what vLLM ``release`` builds for a DeepSeek-V4/V4.1 engine, or why not.

``build(EngineSetup, hf_config)`` is what plan, the controller's prediction, the
replica's self-check, doctor and the presets ask. It mirrors, per release
(``releases.release_rules``): V4.1's attention class selection
(``deepseek_v41/nvidia/model.py::_select_dsv4_attn_cls``, ``amd/model.py``), the
kernel-availability check of mega attention (``FlashMLAMegaAttnAttention.is_available_for``),
the backends' capability checks, V4.1's resolver, the block size vLLM settles on
(``Platform._preferred_block_size_for_backends`` over the main, SWA, indexer and
compressor backends), and the page arithmetic of every KV spec. V4 goes through the
layout tables and byte model of ``layouts``/``dtypes``/``byte_model`` (with dsv4_patch
loaded: stock 0.20-0.29 crash on ``auto``, see ``stock_vllm_crashes_on``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dsv4_patch.rules.byte_model import ModelShape, kv_bytes_per_token, page_breakdown
from dsv4_patch.rules.dtypes import Resolution, resolve_kv_cache_dtype, upstream_resolver_decision
from dsv4_patch.rules.engine_setup import EngineSetup
from dsv4_patch.rules.family import (
    FIRST_V41_VLLM,
    FLASHINFER_V41,
    FP8_DS_MLA,
    MEGA_V41,
    NVFP4_DS_MLA,
    NVFP4_RECORD,
    ROW_ALIGNMENT,
    V4_ALIGNMENT,
    V4_BLOCK_SIZE,
    V4_RECORD,
    V41_MXFP8_ALIGNMENT,
    V41_MXFP8_RECORD,
    Family,
    KVRecord,
    V41Cache,
    V41Topology,
    family_of,
    is_mxfp8_node,
    resolve_v41_kv_cache_dtype,
    v41_bytes_per_token,
    v41_caches,
    v41_refusal,
)
from dsv4_patch.rules.layouts import (
    KVCacheDtypeError,
    LayoutDecision,
    LayoutError,
    detect_layout,
)
from dsv4_patch.rules.model_config import flatten_config
from dsv4_patch.rules.releases import release_rules
from dsv4_patch.rules.v41_backend import V41Choice, mega_fits, v41_attention
from dsv4_patch.rules.versions import parse_version

FIRST_V4 = (0, 20)
# The release plan/predictions assume for V4.1 when nothing names one (the gpu-v41 stack).
DEFAULT_V41_RELEASE = "0.33.0"
SWA_KERNEL_MULTIPLE = 32  # DeepseekSparseSWABackend: [MultipleOf(32)]
V4_INDEXER_BLOCKS = (256,)  # DeepseekV4IndexerBackend: [256]


@dataclass(frozen=True)
class Built:
    """What the engine builds: attention backend, dtype, block, pages, bytes per token."""

    family: Family
    release: str
    backend: str
    cache_dtype_str: str
    packed: bool
    block_size: int
    record: KVRecord | None  # V4.1's per-node record (None for V4)
    page_bytes: dict[str, int]  # per layer group ("main c4", "indexer c4", "swa"...)
    bytes_per_token: float
    numerics: str
    reason: str
    caches: tuple[V41Cache, ...] = field(default=(), repr=False)


def v41_kernel_blocks(setup: EngineSetup, backend: str) -> list[list[int]]:
    """Kernel block sizes (MultipleOf as its base) of every backend a V4.1 engine registers:
    main attention, SWA, indexer, compressor."""
    rel = release_rules(setup.release)
    fam = setup.capability[0] if setup.platform == "cuda" and setup.capability else None
    if setup.platform == "rocm":  # gfx942 -> (9, 4), gfx950 -> (9, 5): family 9
        fam = 9
        main = [64, 128] if parse_version(setup.release)[:2] >= (0, 32) else [64]
    elif backend == MEGA_V41:
        main = [128]
    elif backend == FLASHINFER_V41:
        main = [rel.v41_sm120_block] if fam == 12 else [128]
    else:
        main = [64 if fam == 9 else 128]
    indexer = [rel.v41_sm120_block] if fam == 12 else [64 if fam == 9 else 128]
    return [main, [SWA_KERNEL_MULTIPLE], indexer, [1]]


def common_block_size(sizes: list[list[int]], default: int) -> int:
    """``_preferred_block_size_for_backends``: the smallest size every backend accepts."""
    def accepts(options: list[int], block: int) -> bool:
        return not options or any(block % s == 0 for s in options)

    if all(accepts(s, default) for s in sizes):
        return default
    for candidate in sorted({math.lcm(*p) for p in itertools.product(*(s or [1] for s in sizes))}):
        if all(accepts(s, candidate) for s in sizes):
            return candidate
    raise LayoutError(f"the attention backends share no KV cache block size ({sizes})")


def _v41_block(setup: EngineSetup, backend: str) -> int:
    sizes = v41_kernel_blocks(setup, backend)
    if setup.block_size is None:
        return common_block_size(sizes, release_rules(setup.release).default_block_size)
    bad = [s for s in sizes if not any(setup.block_size % k == 0 for k in s)]
    if bad:
        raise LayoutError(
            f"block_size={setup.block_size}: {backend} on this node needs a multiple of "
            f"{bad[0]} (every backend of DeepSeek-V4.1 must accept it). Fix: unset block_size "
            f"or use {common_block_size(sizes, 256)}.")
    return setup.block_size


def v41_node_record(setup: EngineSetup, fits: bool = True) -> KVRecord:
    """The V4.1 record one node writes (no topology needed); raises where vLLM refuses."""
    if parse_version(setup.release)[:2] < FIRST_V41_VLLM:
        raise LayoutError(f"vLLM {setup.release} has no DeepSeek-V4.1 (first: 0.30). Fix: "
                          "run vLLM 0.30 or newer (the gpu-v41 extra).")
    choice = v41_attention(setup, fits)
    cap = setup.capability
    mxfp8 = is_mxfp8_node(setup.platform, cap)
    if release_rules(setup.release).v41_preferred_resolver:
        dtype, torch_name = resolve_v41_kv_cache_dtype(choice.packed, setup.kv_cache_dtype,
                                                       choice.preferred, mxfp8)
    else:  # 0.30: V4's resolver (fp8* -> fp8_ds_mla; nvfp4_ds_mla refused)
        decision = upstream_resolver_decision(choice.packed, setup.kv_cache_dtype or "auto")
        if decision.error is not None:
            raise KVCacheDtypeError(v41_refusal(setup.kv_cache_dtype))
        dtype, torch_name = str(decision.cache_dtype_str), str(decision.torch_dtype)
    _check_indexer_dtype(setup)
    return _v41_record(choice, dtype, torch_name, mxfp8, _v41_block(setup, choice.backend))


def _check_indexer_dtype(setup: EngineSetup) -> None:
    """``dsa_indexer_uses_fp4``: mxfp4 on SM10x, or ROCm CDNA4 (gfx950) from 0.32."""
    value = setup.indexer_kv_dtype
    if value in (None, "auto", "fp8"):
        return
    if value != "mxfp4":
        raise KVCacheDtypeError(f"indexer_kv_dtype={value!r} is not supported by the DeepSeek "
                                "sparse indexer (expected fp8 or mxfp4).")
    major = setup.capability[0] if setup.capability else None
    if setup.platform == "rocm" and release_rules(setup.release).v41_rocm_mxfp4_indexer:
        if setup.capability != (9, 5):
            raise KVCacheDtypeError("indexer_kv_dtype='mxfp4' on ROCm requires CDNA4 "
                                    "(gfx950: MI350X/MI355X). Fix: unset indexer_kv_dtype.")
        return
    if setup.platform != "cuda" or major != 10:
        raise KVCacheDtypeError(f"indexer_kv_dtype='mxfp4' needs SM10x (B200/GB200) on vLLM "
                                f"{setup.release}; this node is {setup.platform} "
                                f"{setup.capability}. Fix: unset indexer_kv_dtype.")


def v41_record(platform: str, capability: tuple[int, int] | None, backend: str | None,
               requested: str | None, block_size: int | None = None, *,
               release: str = DEFAULT_V41_RELEASE, tp: int = 1, lora: bool = False,
               hf_config: Mapping[str, Any] | None = None) -> KVRecord:
    """Shorthand for ``v41_node_record``; without ``hf_config`` the heads fit mega (V4.1-Flash)."""
    setup = EngineSetup(release, platform, capability, tp, block_size, requested,
                        backend.upper() if backend else None, lora=lora)
    return v41_node_record(setup, True if hf_config is None else mega_fits(hf_config, tp))


def build_v41(setup: EngineSetup, hf_config: Mapping[str, Any]) -> Built:
    """DeepSeek-V4.1 on one node (raises LayoutError / KVCacheDtypeError: vLLM refuses)."""
    record = v41_node_record(setup, mega_fits(hf_config, setup.tp))
    topo = V41Topology.from_hf_config(hf_config)
    dspark = setup.speculative_method == "dspark"
    caches = v41_caches(topo, record, indexer_fp4=setup.indexer_kv_dtype == "mxfp4",
                        num_speculative_tokens=setup.num_speculative_tokens, dspark=dspark)
    pages = {f"{c.role} c{c.compress_ratio}" if c.role != "swa" else "swa": c.page_size_bytes
             for c in caches}
    return Built(Family.V41, setup.release, record.backend, record.cache_dtype_str,
                 record.packed, record.block_size, record, pages, v41_bytes_per_token(caches),
                 record.numerics, record.reason, tuple(caches))


def _v41_record(choice: V41Choice, dtype: str, torch_name: str, mxfp8: bool,
                block: int) -> KVRecord:
    # The specs size packed pages whenever the dtype is packed: 0.30's V4 resolver keeps
    # fp8_ds_mla on a plain-row backend, and its spec then pads a packed page.
    if choice.packed or dtype == FP8_DS_MLA:
        swa = V41_MXFP8_RECORD if mxfp8 else V4_RECORD
        compressed = NVFP4_RECORD if dtype == NVFP4_DS_MLA else swa
        align = V41_MXFP8_ALIGNMENT if mxfp8 else V4_ALIGNMENT
        numerics = ("MXFP8 e4m3, one UE8M0 scale per 32 dims (RoPE in fp8)" if mxfp8 else
                    "fp8 e4m3 NoPE, one UE8M0 scale per 64 dims, bf16 RoPE")
        if dtype == NVFP4_DS_MLA:
            numerics += "; compressed cache NVFP4 e2m1 with e4m3 scales"
        return KVRecord(Family.V41, dtype, True, swa, compressed, align, align, block,
                        choice.backend, numerics, choice.reason if choice.packed else
                        f"{choice.reason}; vLLM sizes packed pages for {dtype}")
    row = 512 * (1 if torch_name == "float8_e4m3fn" else 2)
    numerics = "per-tensor fp8 e4m3 rows" if row == 512 else "bf16 rows"
    return KVRecord(Family.V41, dtype, False, row, row, ROW_ALIGNMENT, ROW_ALIGNMENT, block,
                    choice.backend, numerics, choice.reason)


@dataclass(frozen=True)
class V4Node:
    """DeepSeek-V4 on one node before the model's size matters: the layout, and what the
    requested ``kv_cache_dtype`` becomes on it."""

    decision: LayoutDecision
    resolution: Resolution


def build_v4_node(setup: EngineSetup, decided: LayoutDecision | None = None) -> V4Node:
    """The node step of ``build`` for DeepSeek-V4, the one resolution of ``auto`` (no model
    config needed, as ``v41_node_record`` for V4.1).

    The layout is the release's tables' for the node, or ``decided`` where the caller
    knows it another way (the replica asked its installed vLLM; a replica reported it).
    Raises ``LayoutError`` / ``KVCacheDtypeError`` naming the setting and the fix.
    """
    decision = decided or detect_layout(setup.platform, setup.capability,
                                        setup.attention_backend, setup.release)
    return V4Node(decision, resolve_kv_cache_dtype(decision.layout, setup.kv_cache_dtype))


def build_v4(setup: EngineSetup, hf_config: Mapping[str, Any]) -> Built:
    """DeepSeek-V4 (with dsv4_patch loaded) on one node; raises where vLLM refuses."""
    if parse_version(setup.release)[:2] < FIRST_V4:
        raise LayoutError(f"vLLM {setup.release} has no DeepSeek-V4 (first: 0.20).")
    node = build_v4_node(setup)
    decision, res = node.decision, node.resolution
    block = setup.block_size or V4_BLOCK_SIZE
    if block % V4_INDEXER_BLOCKS[0]:
        raise LayoutError(f"block_size={block}: DeepSeek-V4's indexer backend takes "
                          f"{V4_BLOCK_SIZE}-token blocks only (a multiple of "
                          f"{V4_BLOCK_SIZE}). Fix: unset block_size or set {V4_BLOCK_SIZE}.")
    shape = ModelShape.from_hf_config(flatten_config(hf_config))
    pages: dict[str, int] = {}
    for row in page_breakdown(shape, res.storage, block):
        pages[f"main c{row.ratio}"] = row.main_page_bytes
        if row.indexer_page_bytes:
            pages[f"indexer c{row.ratio}"] = row.indexer_page_bytes
    return Built(Family.V4, setup.release, decision.backend, res.cache_dtype_str,
                 decision.layout.value == FP8_DS_MLA, block, None, pages,
                 kv_bytes_per_token(shape, res.storage, block), res.storage.value,
                 decision.reason)


def build(setup: EngineSetup, hf_config: Mapping[str, Any]) -> Built:
    """What vLLM ``setup.release`` builds for this model on this node and engine config.

    Raises ``LayoutError``/``KVCacheDtypeError`` (the refusal, naming the setting and
    the fix) where vLLM would refuse; ``ValueError`` when the config is not ours.
    """
    family = family_of(hf_config)
    if family is Family.V41:
        return build_v41(setup, hf_config)
    if family is Family.V4:
        return build_v4(setup, hf_config)
    raise ValueError(f"architectures={list(hf_config.get('architectures') or [])}: not a "
                     "DeepSeek-V4 or V4.1 config.json")


def refusal(setup: EngineSetup, hf_config: Mapping[str, Any]) -> str | None:
    """Why vLLM refuses this setup, or None when it builds."""
    try:
        build(setup, hf_config)
    except (LayoutError, KVCacheDtypeError) as exc:
        return str(exc)
    return None
