"""The replica's pre-engine checks, in-process: node probe, kv_cache_dtype resolution, refusal."""

from __future__ import annotations

import pytest
from ray.serve.llm import LLMConfig

from deployments.config import DSv4Section
from deployments.serving.server import KVLayoutMismatch, probe_node, resolve_for_replica
from dsv4_patch import rules
from dsv4_patch.node import NodeInfo


def llm_config(**engine_kwargs: object) -> LLMConfig:
    return LLMConfig(model_loading_config={"model_id": "m", "model_source": "/nonexistent"},
                     engine_kwargs=engine_kwargs)


def test_probe_finds_this_cpu_node() -> None:
    node = probe_node(DSv4Section(), {})
    assert node.platform == "cpu" and node.capability is None and node.source == "probe"


def test_auto_becomes_fp8_on_fp8_ds_mla_and_reaches_the_cached_engine_config() -> None:
    config = llm_config(kv_cache_dtype="auto")
    cached = config.get_engine_config()  # Ray Serve LLM caches this at build time
    res = resolve_for_replica(config, DSv4Section(), NodeInfo("cpu", None, None, "probe"))
    assert (res.engine_dtype, res.cache_dtype_str) == ("fp8", "fp8_ds_mla")
    assert config.engine_kwargs["kv_cache_dtype"] == "fp8"
    assert cached.engine_kwargs["kv_cache_dtype"] == "fp8"


def test_explicit_fp8_is_kept_and_bf16_is_refused() -> None:
    config = llm_config(kv_cache_dtype="fp8_e4m3")
    assert resolve_for_replica(config, DSv4Section(),
                        NodeInfo("cpu", None, None, "probe")).engine_dtype == "fp8_e4m3"
    with pytest.raises(rules.KVCacheDtypeError, match=r"bfloat16.*Fix"):
        resolve_for_replica(llm_config(kv_cache_dtype="bfloat16"), DSv4Section(),
                     NodeInfo("cpu", None, None, "probe"))


def test_replica_refuses_a_node_that_contradicts_the_expectation() -> None:
    # Declared fp8_ds_mla, but this replica landed on a B200 told to use FlashInfer DSv4.
    node = NodeInfo("cuda", (10, 0), "FLASHINFER_MLA_SPARSE_DSV4", "probe")
    config = llm_config(kv_cache_dtype="auto")
    with pytest.raises(KVLayoutMismatch) as info:
        resolve_for_replica(config, DSv4Section(), node)
    message = str(info.value)
    assert "dsv4.expected_layout='fp8_ds_mla'" in message and "plain_rows" in message
    assert "Fix:" in message
    assert config.engine_kwargs["kv_cache_dtype"] == "auto"  # nothing changed on refusal
    plain = DSv4Section(expected_layout="plain_rows")
    res = resolve_for_replica(config, plain, node)
    assert (res.engine_dtype, res.storage.value) == ("auto", "bf16_rows")
