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
from deployments.config.pd import POOLS, PDAppArgs
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


def pool_args(args: PDAppArgs, pool: str) -> AppArgs:
    """One P/D pool seen as a one-pool app: its node, engine changes, model and replicas.

    ``plan`` then sizes the pool with the same code as a one-pool app, so a pool whose
    own ``node`` or ``tensor_parallel_size`` differs gets its own capacity figures.
    """
    data = args.model_dump(mode="json", exclude={"pd"}, exclude_none=True)
    section = args.pd.pool(pool)
    data["llm"]["engine_kwargs"] |= {k: v for k, v in section.engine_kwargs.items()
                                     if k != "kv_transfer_config"}
    if section.model_source:
        data["llm"]["model_loading_config"]["model_source"] = section.model_source
    data["llm"]["deployment_config"] = args.pool_deployment_config(pool).model_dump(
        mode="json", exclude_none=True)
    data["dsv4"] = args.pool_dsv4(pool)
    return AppArgs.model_validate(data)


def plan_pool_capacities(name: str, args: PDAppArgs,
                         config_path: Path | None = None) -> dict[str, KVCapacityPlan]:
    """``plan_capacity`` of each P/D pool (``pool_args``), keyed by pool name."""
    return {pool: plan_capacity(f"{name} ({pool} pool)", pool_args(args, pool), config_path)
            for pool in POOLS}
