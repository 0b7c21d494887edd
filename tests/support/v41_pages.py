"""DeepSeek-V4.1-Flash's config and the page sizes vLLM's own spec classes give its caches.

Shared by the rules' tests (tests/test_dsv4_patch/test_rules_v41.py) and the stand-in's
(tests/test_deployments/test_kvspec.py): the byte model is checked against these, never
against hand-typed bytes. ``real_spec`` imports vLLM and torch when called.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsv4_patch import rules
from dsv4_patch.rules.family import KVRecord

REPO = Path(__file__).resolve().parents[2]
V41_FLASH = json.loads((REPO / "configs" / "models" / "deepseek-ai" / "DeepSeek-V4.1-Flash" /
                        "config.json").read_text())


def real_spec(cache: rules.V41Cache, record: KVRecord, head_dim: int) -> int:
    """The page size vLLM's own spec class gives the same cache (attention.py, compressor.py)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
    )

    dtype = torch.uint8 if record.packed else (
        torch.float8_e4m3fn if record.swa_bytes == head_dim else torch.bfloat16)
    if cache.role == "swa":
        return SlidingWindowMLASpec(
            block_size=cache.block_size, num_kv_heads=1, head_size=head_dim, dtype=dtype,
            sliding_window=128, cache_dtype_str=record.cache_dtype_str,
            state_content_bytes=record.swa_bytes if record.packed else None,
            alignment=record.alignment if record.packed else 512,
            model_version="deepseek_v4").page_size_bytes
    if cache.role == "main":
        return MLAAttentionSpec(
            block_size=cache.block_size, num_kv_heads=1, head_size=head_dim, dtype=dtype,
            tokens_per_state=cache.compress_ratio, cache_dtype_str=record.cache_dtype_str,
            alignment=record.alignment if record.packed else 512, model_version="deepseek_v4",
            state_content_bytes=record.compressed_bytes if record.packed else None,
        ).page_size_bytes
    if cache.role == "indexer":
        return MLAAttentionSpec(
            block_size=cache.block_size, num_kv_heads=1, head_size=rules.family.INDEXER_FP8_ROW,
            dtype=torch.uint8, tokens_per_state=cache.compress_ratio,
            alignment=record.indexer_alignment).page_size_bytes
    return CircularBufferSpec(block_size=cache.block_size, num_kv_heads=1,
                              head_size=2 * head_dim, head_size_v=0,
                              dtype=torch.float32).page_size_bytes
