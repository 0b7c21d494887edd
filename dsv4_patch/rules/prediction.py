"""Per-layer prediction of the KV cache specs a DeepSeek-V4 config gives on a layout."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsv4_patch.rules.byte_model import ModelShape, page_breakdown
from dsv4_patch.rules.dtypes import Resolution
from dsv4_patch.rules.family import FIRST_V41_VLLM, V41_ARCHITECTURES, Family, family_of
from dsv4_patch.rules.model_config import flatten_config
from dsv4_patch.rules.versions import parse_version

# ---------------------------------------------------------- per-layer prediction

# vLLM gives DeepSeek-V4 256-token cache blocks on every platform (the sparse SWA
# backend pins it; the CPU platform forces it): vllm/platforms/cpu.py and the DSv4
# attention backends' get_supported_kernel_block_sizes (vLLM 0.30-0.32).
DSV4_BLOCK_SIZE = 256
# The first vLLM release with DeepSeek-V4 (docs/design.md, section 2).
FIRST_DSV4_VLLM = (0, 20)
DSV4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)

# Roles of the KV specs one DeepSeek-V4 layer registers, by the suffix vLLM gives
# the module (vllm/models/deepseek_v4/attention.py, compressor.py).
MAIN, INDEXER = "main", "indexer"


@dataclass(frozen=True)
class PredictedLayer:
    """The KV spec the byte model predicts for one cache of one decoder layer."""

    index: int
    role: str  # MAIN (the compressed attention cache) or INDEXER (the C4 sparse indexer)
    cache_dtype_str: str | None
    page_size_bytes: int
    block_size: int
    compress_ratio: int


def predict_layers(
    shape: ModelShape, resolution: Resolution, block_size: int = DSV4_BLOCK_SIZE
) -> list[PredictedLayer]:
    """Per layer index, the main and indexer caches the engine will allocate.

    The same byte model ``page_breakdown`` sums for ``dsv4-serve plan``, laid out
    layer by layer so a replica whose layer kinds sit in another order (a different
    model, whose pages cannot move layer for layer) differs from the prediction.
    SWA-only layers (ratio 0/1) have no compressed cache; the bounded SWA and
    compressor-state caches are not predicted (peers still compare them).
    """
    rows = {row.ratio: row for row in page_breakdown(shape, resolution.storage, block_size)}
    out: list[PredictedLayer] = []
    for index, ratio in enumerate(shape.compress_ratios):
        if ratio <= 1:
            continue
        row = rows[ratio]
        out.append(PredictedLayer(index, MAIN, resolution.cache_dtype_str,
                                  row.main_page_bytes, block_size, ratio))
        if row.indexer_page_bytes:
            out.append(PredictedLayer(index, INDEXER, None, row.indexer_page_bytes,
                                      block_size, ratio))
    return out


def predictable(hf_config: Mapping[str, Any], vllm_version: str | None) -> str | None:
    """Why no prediction can be made for this config on this vLLM, or None if it can."""
    archs = list(hf_config.get("architectures") or [])
    family = family_of(hf_config)
    if family is None:
        known = [*DSV4_ARCHITECTURES, *V41_ARCHITECTURES]
        return f"architectures={archs}: the byte model knows {known} only"
    if vllm_version is None:
        return "the installed vLLM version is unknown"
    if parse_version(vllm_version)[:2] < FIRST_DSV4_VLLM:
        return f"vLLM {vllm_version} has no DeepSeek-V4 (first: 0.20)"
    if family is Family.V41 and parse_version(vllm_version)[:2] < FIRST_V41_VLLM:
        return f"vLLM {vllm_version} has no DeepSeek-V4.1 (first: 0.30)"
    flat = flatten_config(hf_config)
    keys = ("num_hidden_layers", "compress_ratios", "head_dim", "index_head_dim",
            *(("kv_source_layer_ids", "index_source_layer_ids") if family is Family.V41
              else ("qk_rope_head_dim",)))
    missing = [k for k in keys if k not in flat]
    if missing:
        return f"config.json lacks {missing}"
    return None
