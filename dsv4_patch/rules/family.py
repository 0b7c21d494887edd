"""The DeepSeek-V4 family: which member a config is, and its KV record on a node.

V4 (Flash, Pro; ``DeepseekV4ForCausalLM``) writes one packed record everywhere
(584 B, 576 B pages, 256-token blocks). V4.1 (``DeepseekV41ForCausalLM``, the VL
model wrapping the text model; vLLM 0.30+, ``vllm/models/deepseek_v41/``) writes a
record that depends on the GPU under one dtype name (vllm#56893) and, on SM100's
default FlashMLA "mega" attention, a second packed dtype ``nvfp4_ds_mla``
(vllm#56935). Everything here mirrors ``vllm/models/deepseek_v41/attention.py``
(0.32.0 and 0.33.0 agree on every byte below); tests/test_dsv4_patch/
test_rules_v41.py checks it against the installed code and the 0.33.0 wheel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from dsv4_patch.rules.byte_model import LayerGeometry
from dsv4_patch.rules.layouts import KVCacheDtypeError
from dsv4_patch.rules.model_config import flatten_config

# ------------------------------------------------------------------ members


class Family(str, Enum):
    """Which DeepSeek-V4 generation a config describes (it decides the KV rules)."""

    V4 = "deepseek_v4"
    V41 = "deepseek_v41"


V4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)
# The registered V4.1 architecture is the VL model (nvidia/vl_model.py) wrapping
# the text model; its DSpark draft registers as DSparkV41DraftModel.
V41_ARCHITECTURES = ("DeepseekV41ForCausalLM",)
DSPARK_V41_ARCHITECTURE = "DSparkV41DraftModel"
FIRST_V41_VLLM = (0, 30)


def family_of(hf_config: Mapping[str, Any]) -> Family | None:
    """The family of a ``config.json`` by its architectures (None: not ours)."""
    archs = set(hf_config.get("architectures") or [])
    if archs & {*V41_ARCHITECTURES, DSPARK_V41_ARCHITECTURE}:
        return Family.V41
    if archs & set(V4_ARCHITECTURES):
        return Family.V4
    return None


def text_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The flat config as ``DeepseekV41Config`` builds it (``model_config.flatten_config``)."""
    return flatten_config(hf_config)


# ------------------------------------------------------------------ records

V4_RECORD = 584  # 448 fp8 NoPE + 128 bf16 RoPE + 7 UE8M0 scales + 1 pad byte
V4_ALIGNMENT = 576
V41_MXFP8_RECORD = 528  # 512 fp8 dims + 16 UE8M0 scales (one per 32 dims), SM100 only
V41_MXFP8_ALIGNMENT = 512  # the SM100 kernel's TMA stride
NVFP4_RECORD = 288  # 256 B of e2m1 pairs + 32 e4m3 scales: the compressed cache only
ROW_ALIGNMENT = 512
INDEXER_FP8_ROW = 132  # 128 fp8 + one fp32 scale (V3.2 layout)
INDEXER_MXFP4_ROW = 68  # 64 B of packed e2m1 + 4 UE8M0 scales of 32 values
SWA_BLOCK = 32  # DeepseekV4SWACache(block_size=32) on every V4.1 layer
V4_BLOCK_SIZE = 256
# V4.1's main and indexer backends' kernel block size: 64 on SM90, 128 elsewhere
# (deepseek_v41/sparse_mla.py and v1/attention/backends/mla/indexer.py); with the
# SWA backend's MultipleOf(32) and the compressor's MultipleOf(1), vLLM's common
# block size is that value unless --block-size says otherwise.
V41_BLOCK_SM90, V41_BLOCK_OTHER = 64, 128
RING_STATE_BYTES = 4  # the compressor ring holds fp32 [kv, score] rows

FP8_DS_MLA, NVFP4_DS_MLA = "fp8_ds_mla", "nvfp4_ds_mla"
PACKED_DTYPES = (FP8_DS_MLA, NVFP4_DS_MLA)

# V4.1's CUDA attention classes (deepseek_v41/nvidia/model.py::_select_dsv4_attn_cls).
FLASHMLA_V41 = "FLASHMLA_SPARSE_DSV41"
MEGA_V41 = "FLASHMLA_MEGA_ATTN_DSV41"
FLASHINFER_V41 = "FLASHINFER_MLA_SPARSE_DSV41"
WV_GROUP_SIZE = 8  # mega attention wants 8 heads per wo_a group (common/ops/fused_layout.py)


def is_mxfp8_node(platform: str, capability: tuple[int, int] | None) -> bool:
    """``_use_v41_mxfp8_kv_record()``: the SM100 family (10.x) writes the 528 B record."""
    return platform == "cuda" and capability is not None and capability[0] == 10


def default_block_size(family: Family, platform: str,
                       capability: tuple[int, int] | None, sm120_block: int = V41_BLOCK_OTHER
                       ) -> int:
    """The cache block size vLLM picks without ``--block-size`` (V4.1: the kernels'
    ``[64 if is_device_capability_family(90) else 128]``; ROCm's gfx942/gfx950 report
    (9, 4)/(9, 5), family 9; SM12x per release, ``sm120_block``)."""
    if family is Family.V4:
        return V4_BLOCK_SIZE
    if platform == "rocm" or (platform == "cuda" and capability is not None
                              and capability[0] == 9):
        return V41_BLOCK_SM90
    if platform == "cuda" and capability is not None and capability[0] == 12:
        return sm120_block
    return V41_BLOCK_OTHER


def v41_refusal(requested: object) -> str:
    """Upstream's words first (code that matches on them keeps working), then our fix."""
    return (
        f"DeepseekV4 packed KV layouts only support fp8 kv-cache, got {requested}. "
        f"kv_cache_dtype={requested!r} cannot be stored on DeepSeek-V4.1's packed layout "
        "(V4.1 refuses the fp8 aliases V4 accepts). Fix: set kv_cache_dtype: auto (or fp8, "
        f"{FP8_DS_MLA}; {NVFP4_DS_MLA} on SM100), or select {FLASHINFER_V41} for plain rows.")


def resolve_v41_kv_cache_dtype(packed: bool, requested: str | None, preferred: str,
                               mxfp8: bool) -> tuple[str, str]:
    """V4.1's 4-argument resolver: ``(cache_dtype_str, torch dtype name)`` or an error.

    Packed: ``auto``/``fp8`` -> the layer's preferred record (written back);
    ``*_ds_mla`` kept; ``fp8_e4m3``/``fp8_e5m2``/``bfloat16`` refused. ``nvfp4_ds_mla``
    needs the SM100 records. Plain rows: fp8* -> e4m3 rows, else bf16; ``*_ds_mla`` refused.
    """
    value = "auto" if requested is None else str(requested)
    if packed:
        if value in ("auto", "fp8"):
            value = preferred
        elif not value.endswith("_ds_mla"):
            raise KVCacheDtypeError(v41_refusal(requested))
        if value == NVFP4_DS_MLA and not mxfp8:
            raise KVCacheDtypeError(
                f"kv_cache_dtype={requested!r}: nvfp4_ds_mla needs the V4.1 KV records, "
                "which FlashMLA decodes only on SM100. Fix: use auto or fp8 on this node.")
        return value, "uint8"
    if value.endswith("_ds_mla"):
        raise KVCacheDtypeError(
            f"kv_cache_dtype={requested!r} is a packed FlashMLA DeepSeek V4.1 KV cache format; "
            "the selected backend stores plain KV rows. Fix: set auto (bf16 rows) or fp8.")
    return value, ("float8_e4m3fn" if value.startswith("fp8") else "bfloat16")


@dataclass(frozen=True)
class KVRecord:
    """What one node writes per stored state, and how pages are padded.

    ``numerics`` names what the stored numbers are, so two groups of replicas can
    be told apart by more than their byte counts.
    """

    family: Family
    cache_dtype_str: str
    packed: bool
    swa_bytes: int
    compressed_bytes: int
    alignment: int
    indexer_alignment: int
    block_size: int
    backend: str
    numerics: str
    reason: str = ""

    def label(self) -> str:
        return (f"{self.cache_dtype_str} ({self.swa_bytes} B SWA / {self.compressed_bytes} B "
                f"compressed records, {self.alignment} B pages, block {self.block_size})")


# ------------------------------------------------------------------ topology


@dataclass(frozen=True)
class V41Topology(LayerGeometry):
    """The parts of a V4.1 config that place caches on layers (ratios: backbone layers
    only; 0 is a sliding-window layer)."""

    kv_sources: tuple[int, ...]
    index_sources: tuple[int, ...]
    # DSpark draft layers (layers.{num_layers + i}, pure SWA), counted as vLLM does
    # (deepseek_v41/nvidia/dspark.py: n_mtp_layers or num_nextn_predict_layers or 3).
    draft_layers: int

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> V41Topology:
        flat = text_config(cfg)
        n = int(flat["num_hidden_layers"])
        ratios = [int(r) for r in flat.get("compress_ratios") or []]
        missing = [k for k in ("kv_source_layer_ids", "index_source_layer_ids")
                   if not flat.get(k)]
        if any(r > 0 for r in ratios[:n]) and missing:
            raise ValueError(f"config lacks {missing}: DeepSeek V4.1 requires them for "
                             "compressed layers (deepseek_v41/attention.py).")
        bad = sorted({r for r in ratios if r not in (0, 1, 2)})
        if bad:
            raise ValueError(f"compress_ratios holds {bad}; V4.1 supports 0 (sliding "
                             "window), 1 and 2 only.")
        return cls(
            num_layers=n,
            compress_ratios=tuple(ratios[:n] + [0] * max(0, n - len(ratios))),
            kv_sources=tuple(int(i) for i in flat.get("kv_source_layer_ids") or ()),
            index_sources=tuple(int(i) for i in flat.get("index_source_layer_ids") or ()),
            head_dim=int(flat["head_dim"]),
            index_head_dim=int(flat["index_head_dim"]),
            draft_layers=int(flat.get("n_mtp_layers") or flat.get("num_nextn_predict_layers")
                             or 3),
        )


def round_up(value: int, multiple: int) -> int:
    """vLLM's ``round_up`` (``_apply_alignment_padding``)."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class V41Cache:
    """One cache of one V4.1 layer: its role, page and whether it grows with context."""

    index: int
    role: str  # main | indexer | swa | compressor_state
    cache_dtype_str: str | None
    page_size_bytes: int
    block_size: int
    compress_ratio: int
    grows: bool  # False: bounded per request (SWA window, the compressor ring)


def v41_caches(topo: V41Topology, record: KVRecord, indexer_fp4: bool = False,
               num_speculative_tokens: int = 0, dspark: bool = False) -> list[V41Cache]:
    """Every KV cache a V4.1 engine registers, per layer, as the config's topology places it.

    SWA cache on every layer (and on each DSpark draft layer, when ``dspark``);
    compressed KV on ``kv_source_layer_ids`` only (``tokens_per_state`` = ratio); the
    indexer K cache on layers that are both index and KV sources (other index sources
    reuse it); the compressor's fp32 ring on ratio-2 sources.
    """
    block = record.block_size
    row = INDEXER_MXFP4_ROW if indexer_fp4 else INDEXER_FP8_ROW
    ring = max(8, 1 << (num_speculative_tokens + 1).bit_length())
    swa_page = round_up(SWA_BLOCK * record.swa_bytes, record.alignment)
    out: list[V41Cache] = []
    layers = topo.num_layers + (topo.draft_layers if dspark else 0)
    for i in range(layers):
        ratio = topo.compress_ratios[i] if i < topo.num_layers else 0
        out.append(V41Cache(i, "swa", record.cache_dtype_str, swa_page, SWA_BLOCK, 1, False))
        if i >= topo.num_layers or i not in topo.kv_sources or ratio <= 0:
            continue
        states = block // ratio
        out.append(V41Cache(i, "main", record.cache_dtype_str,
                            round_up(states * record.compressed_bytes, record.alignment),
                            block, ratio, True))
        if i in topo.index_sources:
            out.append(V41Cache(i, "indexer", None,
                                round_up(states * row, record.indexer_alignment),
                                block, ratio, True))
        if ratio > 1:
            out.append(V41Cache(i, "compressor_state", None,
                                ring * 2 * topo.head_dim * RING_STATE_BYTES, ring, 1, False))
    return out


def v41_bytes_per_token(caches: list[V41Cache]) -> float:
    """KV bytes one more context token costs on one rank (the growing caches' pages)."""
    return sum(c.page_size_bytes / c.block_size for c in caches if c.grows)
