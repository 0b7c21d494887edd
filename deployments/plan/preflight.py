"""Preflight a Serve config for GPUs, without GPUs (what `dsv4-serve plan` prints).

For every application (replica type) of a Serve config it answers, before any
node is rented: which KV layout the declared node will use, what
``kv_cache_dtype: auto`` becomes there, what one context token costs in KV bytes
(``dsv4_patch.rules`` byte model), how many context tokens fit per engine and per
replica once the weights are loaded, and every problem -- a config that would
crash on stock vLLM without dsv4_patch, a layout that contradicts the declared
expectation (refused: exit status 1), replicas that would disagree.

The numbers come from ``deployments.plan.weights`` (weight bytes), ``deployments.plan.capacity``
(KV tokens per engine/replica) and ``deployments.config.sizing`` (GPUs per replica); the
policy rules from ``deployments.config.checks``; the table and the CLI are
``deployments.cli.plan``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deployments.config import AppArgs, checks, load_serve_config, refuse_problems
from deployments.config.sizing import Parallel
from deployments.plan import pd as pd_plan
from deployments.plan.capacity import capacity, engine_extra
from deployments.plan.findings import find_problems, fleet_problems
from deployments.plan.model_configs import find_model_config
from deployments.plan.report import (
    NodeCapacity,
    PlanReport,
    ReplicaPlan,
    capability_text,
)
from deployments.plan.v41 import mix_summary, plan_v41_application, v41_problems
from deployments.plan.weights import estimate_weights
from dsv4_patch import rules

__all__ = ["NodeCapacity", "PlanReport", "ReplicaPlan", "capability_text", "fleet_problems",
           "plan_application", "plan_config"]


def plan_application(name: str, args: AppArgs, model_cfg: Mapping[str, Any], *,
                     vllm_version: str | None = None,
                     reserve_gib: float = 0.0) -> ReplicaPlan:
    """Plan one application's replicas on its declared node (each node type of a mixed fleet).

    ``model_cfg``: flat, as ``model_configs.read_config_json`` reads it."""
    node, ek = args.dsv4.node, args.llm.engine_kwargs
    version = vllm_version or args.dsv4.vllm_version or rules.DEFAULT_VLLM[node.platform]
    if rules.family_of(model_cfg) is rules.Family.V41:
        v41 = plan_v41_application(name, args, model_cfg, version, reserve_gib)
        if v41 is not None:
            return v41
    decision = args.predicted_layout(version)
    resolution = rules.build_v4_node(rules.EngineSetup(version, kv_cache_dtype=ek.kv_cache_dtype),
                                     decision).resolution
    shape = rules.ModelShape.from_hf_config(model_cfg)
    weights = estimate_weights(model_cfg)
    block = args.block_size()
    cap = capacity(args, shape, weights, resolution.storage, block, reserve_gib,
                   release=version)
    plan = ReplicaPlan(
        application=name,
        model=args.llm.model_loading_config.model_source or args.llm.model_loading_config.model_id,
        node=node.model_dump(mode="json"),
        parallel=args.parallel().as_dict(),
        vllm_version=version,
        layout=decision.layout.value,
        backend=decision.backend,
        layout_reason=decision.reason,
        expected_layout=args.dsv4.expected_layout.value,
        kv_cache_dtype=ek.kv_cache_dtype,
        engine_kv_cache_dtype=resolution.engine_dtype,
        cache_dtype_str=resolution.cache_dtype_str,
        resolution_reason=resolution.reason,
        block_size=block,
        max_model_len=engine_extra(args, "max_model_len",
                                    model_cfg.get("max_position_embeddings")),
        weights_total_bytes=weights.total,
        parameters=weights.parameters,
        capacity=cap,
    )
    if resolution.storage is not rules.Storage.FP8_DS_MLA:
        plan.fp8_ds_mla_capacity = capacity(args, shape, weights, rules.Storage.FP8_DS_MLA,
                                            block, reserve_gib, release=version)
    par = args.parallel()
    if par.dp > 1:
        as_tp = Parallel(par.tp * par.dp, par.pp, 1, par.ep, par.nodes)
        plan.tp_alternative = capacity(args, shape, weights, resolution.storage, block,
                                       reserve_gib, as_tp, release=version)
    if hasattr(args, "pd"):  # a PDAppArgs
        plan.pd = pd_plan.summary(args, cap.kv_bytes_per_token, block,
                                  cap.kv_tokens_per_replica, plan.max_model_len, version)
    plan.node_capacities = [
        NodeCapacity(key, spec.model_dump(mode="json"), plan.layout,
                     args.dsv4.expected_for(spec.model_dump(mode="json")), plan.backend,
                     plan.cache_dtype_str, block, resolution.reason,
                     cap if spec == node else capacity(args, shape, weights, resolution.storage,
                                                       block, reserve_gib, node=spec,
                                                       release=version))
        for key, spec in args.dsv4.nodes().items()]
    plan.mix = mix_summary(plan.node_capacities)
    plan.problems = find_problems(plan, args, shape)
    if rules.family_of(model_cfg) is rules.Family.V41:  # a node V4.1 cannot run on
        plan.problems = sorted(v41_problems(args, model_cfg, version) + plan.problems,
                               key=lambda p: p.severity != "error")
    return plan


def plan_config(path: str | Path, *, model_config: Path | None = None,
                vllm_version: str | None = None, reserve_gib: float = 0.0) -> PlanReport:
    """Plan every ``deployments.app:build_app`` application of a Serve config."""
    path = Path(path)
    config = load_serve_config(path, refuse=False)  # policy problems are planned, not raised
    plans = []
    for app, args in config.ours():
        # Without a layout and a dtype resolution there is nothing to plan.
        refuse_problems([p for p in checks.check(args) if p.code in checks.UNPLANNABLE],
                        app.where, str(path))
        cfg = find_model_config(args, path, model_config)
        plans.append(plan_application(app.name, args, cfg, vllm_version=vllm_version,
                                      reserve_gib=reserve_gib))
    return PlanReport(str(path), plans, fleet_problems(plans))
