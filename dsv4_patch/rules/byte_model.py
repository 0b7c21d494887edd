"""The byte model: bytes per stored state, page padding, bytes per context token."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsv4_patch.rules.layouts import Storage

# ------------------------------------------------------------------ byte model

FP8_DS_MLA_ALIGNMENT = 576  # fp8_ds_mla pages pad to 576 B multiples
PLAIN_ROW_ALIGNMENT = 512  # plain-row pages pad to 512 B multiples
UE8M0_GROUP = 64  # one UE8M0 scale byte per 64 NoPE values
INDEXER_SCALE_BYTES = 4  # one fp32 scale per indexer key
# The fp8_ds_mla record of one token (DeepSeek-V4 invariants: head_dim 512 = 448 NoPE
# + 64 RoPE): 448 B fp8-e4m3 NoPE + 128 B bf16 RoPE, then 7 UE8M0 scales + 1 pad byte.
# dsv4_patch/patches/cpu/formats.py and benchmarks/ read the geometry from here.
NOPE_DIM = 448
ROPE_DIM = 64
HEAD_DIM = NOPE_DIM + ROPE_DIM
FP8_DS_MLA_TOKEN_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
FP8_DS_MLA_SCALE_BYTES = NOPE_DIM // UE8M0_GROUP + 1  # 8
INDEX_HEAD_DIM = 128  # the sparse indexer's key width (fp8-e4m3, one fp32 scale)


@dataclass(frozen=True)
class LayerGeometry:
    """What a DeepSeek-V4 or V4.1 config says of its backbone layers' caches: how many
    layers, each one's compress ratio, the attention and indexer head widths."""

    num_layers: int
    compress_ratios: tuple[int, ...]
    head_dim: int
    index_head_dim: int

    def layers_with_ratio(self, ratio: int) -> int:
        return sum(1 for r in self.compress_ratios if r == ratio)


@dataclass(frozen=True)
class ModelShape(LayerGeometry):
    """The parts of a DeepSeek-V4 config that size the KV cache."""

    rope_dim: int

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        """Read a HF ``config.json``; the MTP layer's trailing ratio is excluded."""
        n = int(cfg["num_hidden_layers"])
        ratios = tuple(int(r) for r in cfg["compress_ratios"][:n])
        if len(ratios) != n:
            raise ValueError(
                f"compress_ratios has {len(ratios)} entries for num_hidden_layers={n}; "
                "expected one per layer (plus one per MTP layer)."
            )
        return cls(
            num_layers=n,
            compress_ratios=ratios,
            head_dim=int(cfg["head_dim"]),
            rope_dim=int(cfg["qk_rope_head_dim"]),
            index_head_dim=int(cfg["index_head_dim"]),
        )

    @property
    def compressed_ratios(self) -> tuple[int, ...]:
        return tuple(sorted({r for r in self.compress_ratios if r > 1}))


def state_bytes(shape: ModelShape, storage: Storage) -> int:
    """Bytes of one stored KV state (one token, or one compressed group)."""
    storage = Storage(storage)
    if storage is Storage.FP8_DS_MLA:
        nope = shape.head_dim - shape.rope_dim
        scales = nope // UE8M0_GROUP + 1  # 7 UE8M0 scales + 1 pad byte for head_dim 512
        return nope + 2 * shape.rope_dim + scales  # 448 + 128 + 8 = 584
    if storage is Storage.BF16_ROWS:
        return 2 * shape.head_dim  # 1024
    return shape.head_dim  # 512


def page_alignment(storage: Storage) -> int:
    """The multiple vLLM pads a page of ``storage`` to (576 B fp8_ds_mla, 512 B rows)."""
    return FP8_DS_MLA_ALIGNMENT if Storage(storage) is Storage.FP8_DS_MLA else PLAIN_ROW_ALIGNMENT


def padded_page_bytes(states: int, bytes_per_state: int, alignment: int) -> int:
    """Page bytes padded to ``alignment`` (vLLM ``_apply_alignment_padding``)."""
    return math.ceil(states * bytes_per_state / alignment) * alignment


@dataclass(frozen=True)
class PageBreakdown:
    """Per-layer page sizes (bytes per cache block) for one compress ratio."""

    ratio: int
    layers: int
    main_page_bytes: int
    indexer_page_bytes: int

    def bytes_per_token(self, block_size: int) -> float:
        return self.layers * (self.main_page_bytes + self.indexer_page_bytes) / block_size


def page_breakdown(
    shape: ModelShape, storage: Storage, block_size: int = 256
) -> list[PageBreakdown]:
    """Main and indexer page bytes of every compressed layer kind.

    Ratio-4 layers carry the sparse indexer (fp8 keys + fp32 scale); ratio-128
    layers only the main cache. SWA and compressor state are bounded per request
    and excluded: they do not grow with context.
    """
    per_state = state_bytes(shape, storage)
    align = page_alignment(storage)
    rows = []
    for ratio in shape.compressed_ratios:
        states = block_size // ratio
        main = padded_page_bytes(states, per_state, align)
        indexer = (
            padded_page_bytes(states, shape.index_head_dim + INDEXER_SCALE_BYTES, align)
            if ratio == 4
            else 0
        )
        rows.append(PageBreakdown(ratio, shape.layers_with_ratio(ratio), main, indexer))
    return rows


def kv_bytes_per_token(shape: ModelShape, storage: Storage, block_size: int = 256) -> float:
    """KV bytes one context token costs on one rank (pages padded).

    Flash: 3915 (fp8_ds_mla) / 6250 (bf16 rows) / 3482 (fp8 rows);
    Pro: 5609.25 / 8948 / 4984 (docs/design.md, section 1).
    """
    return sum(
        row.bytes_per_token(block_size) for row in page_breakdown(shape, storage, block_size)
    )
