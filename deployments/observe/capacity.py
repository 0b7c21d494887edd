"""KV capacity per node type, as ``dsv4-serve plan`` computes it, for the controller to export.

The figures come from ``deployments.plan.preflight.plan_application`` (the code behind
``dsv4-serve plan``), never re-derived here, so a gauge and the plan table agree for the
same config. vLLM's own ``cache_config_info`` says ``block_size=4`` for DeepSeek-V4
(the minimum over its hybrid cache groups, vllm#51163) and no bytes per token, which is
how DSv4's capacity gets misread (vllm#51041).
"""

from __future__ import annotations

from pathlib import Path

from deployments.config import AppArgs
from deployments.control.wire import KVCapacityPlan, NodeKVCapacity
from deployments.logs import get_logger
from deployments.plan.model_configs import find_model_config
from deployments.plan.preflight import plan_application
from deployments.resources import configs_dir

logger = get_logger("observe")


def plan_capacity(name: str, args: AppArgs, config_path: Path | None = None) -> KVCapacityPlan:
    """``plan``'s capacity rows of one application, or a plan naming why none.

    The model's ``config.json`` is found the way ``plan`` finds it (the tiny model, a
    local directory, or ``configs/models/<model_source>/``); when it is nowhere on the
    node that builds the app, the controller exports no capacity and says so.
    """
    where = config_path or configs_dir() / "local-cpu.yaml"
    try:
        model_cfg = find_model_config(args, where)
        plan = plan_application(name, args, model_cfg)
    except ValueError as exc:  # ConfigError, a layout plan cannot resolve: named, logged
        reason = f"no KV capacity figures for {name}: {exc}"
        logger.warning("dsv4: %s", reason)
        return KVCapacityPlan(reason=reason)
    return KVCapacityPlan(nodes=[
        NodeKVCapacity(node_type=n.node_type, storage=n.capacity.storage,
                       block_size=n.block_size,
                       kv_bytes_per_token=n.capacity.kv_bytes_per_token_per_gpu,
                       kv_budget_bytes=n.capacity.kv_budget_per_gpu_bytes,
                       kv_tokens_per_engine=n.capacity.kv_tokens_per_engine,
                       kv_tokens_per_replica=n.capacity.kv_tokens_per_replica)
        for n in plan.node_capacities])
