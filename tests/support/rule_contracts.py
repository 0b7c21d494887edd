"""Rule helpers only the tests use: contracts read against vLLM's own code and pool
comparisons the tests state facts with. The product decides through ``dsv4_patch.rules``
and ``deployments.control.prediction``; these restate a contract, they do not decide."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deployments.control.prediction import node_record_fields
from dsv4_patch.rules.dtypes import resolve_kv_cache_dtype
from dsv4_patch.rules.layouts import Layout, Storage


def engine_resolver_result(use_fp8_ds_mla_layout: bool, kv_cache_dtype: str) -> tuple[str, str]:
    """What the in-engine resolver must return: ``(cache_dtype_str, torch dtype name)``.

    The contract of vLLM's ``_resolve_dsv4_kv_cache_dtype`` after PR #55134:
    packed -> ("fp8_ds_mla", "uint8"); plain fp8 -> (value, "float8_e4m3fn");
    plain auto/bfloat16 -> (value, "bfloat16"). Raises KVCacheDtypeError as
    ``resolve_kv_cache_dtype`` does.
    """
    layout = Layout.FP8_DS_MLA if use_fp8_ds_mla_layout else Layout.PLAIN_ROWS
    res = resolve_kv_cache_dtype(layout, kv_cache_dtype)
    torch_name = {
        Storage.FP8_DS_MLA: "uint8",
        Storage.FP8_ROWS: "float8_e4m3fn",
        Storage.BF16_ROWS: "bfloat16",
    }[res.storage]
    return res.cache_dtype_str, torch_name


def is_nested(cfg: Mapping[str, Any]) -> bool:
    """Whether ``cfg`` is in the published nested V4.1 layout."""
    return isinstance(cfg.get("text_config"), Mapping)


def pool_node_differences(hf_config: Mapping[str, Any], prefill_node: Mapping[str, Any],
                          decode_node: Mapping[str, Any], requested: str | None,
                          vllm_version: str | None = None,
                          engine: Mapping[str, Any] | None = None
                          ) -> list[tuple[str, Any, Any]]:
    """``(field, prefill, decode)`` where the two pools' nodes write other KV bytes.

    Decided from the declared nodes before any replica exists: NIXL's handshake
    compares dtype and backend names, not record bytes, so a V4.1 SM90 pool (584 B
    records, 576 B pages, block 64) and an SM100 pool (528 B / 512 B, block 128, and
    NVFP4 under mega attention) would pass it. V4 writes one record on SM90 and SM100
    FlashMLA alike, so such V4 pools agree.
    """
    mine = node_record_fields(hf_config, prefill_node, requested, vllm_version, engine)
    theirs = node_record_fields(hf_config, decode_node, requested, vllm_version, engine)
    return [(f, mine[f], theirs[f]) for f in mine if mine[f] != theirs[f]]
