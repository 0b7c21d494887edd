"""DeepSeek-V4.1's plan: each node type's build (``rules.build``), capacity and refusals."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from deployments.config import AppArgs, NodeSpec, checks
from deployments.config.checks import Finding
from deployments.config.dsv4 import node_type_key
from deployments.config.sizing import Parallel
from deployments.control.prediction import node_record_fields
from deployments.plan import pd as pd_plan
from deployments.plan.capacity import engine_extra, v41_capacity
from deployments.plan.findings import _capacity_problems, _override_problems
from deployments.plan.report import NodeCapacity, ReplicaPlan, capability_text
from deployments.plan.weights import WeightEstimate, estimate_weights
from dsv4_patch import rules


def node_setup(args: AppArgs, spec: NodeSpec, version: str,
               par: Parallel | None = None) -> rules.EngineSetup:
    """What vLLM ``version`` reads on node ``spec`` from this app's engine kwargs."""
    ek = args.llm.engine_kwargs
    kwargs = {**(ek.model_extra or {}), **ek.model_dump(exclude_none=True)}
    if par is not None:
        kwargs["tensor_parallel_size"] = par.tp
    return rules.EngineSetup.from_engine_kwargs(version, spec.platform, spec.compute_capability,
                                                spec.attention_backend, kwargs)


def v41_node_capacity(args: AppArgs, spec: NodeSpec, model_cfg: Mapping[str, Any],
                      version: str, weights: WeightEstimate, reserve_gib: float,
                      par: Parallel | None = None) -> NodeCapacity:
    """DeepSeek-V4.1 on one node type: what vLLM ``version`` builds there and its tokens.

    Raises ``rules.LayoutError`` / ``rules.KVCacheDtypeError`` where vLLM refuses.
    """
    built = rules.build(node_setup(args, spec, version, par), model_cfg)
    record = built.record
    assert record is not None
    node = spec.model_dump(mode="json")
    return NodeCapacity(
        node_type=node_type_key(node), node=node,
        layout=record.cache_dtype_str if record.packed else "plain_rows",
        expected_layout=args.dsv4.expected_for(node), backend=record.backend,
        cache_dtype_str=record.cache_dtype_str, block_size=record.block_size,
        numerics=f"{record.numerics}; {built.reason}",
        capacity=v41_capacity(args, list(built.caches), topo_layers(model_cfg), weights,
                              reserve_gib, spec, par, version))


def topo_layers(model_cfg: Mapping[str, Any]) -> int:
    return rules.V41Topology.from_hf_config(model_cfg).num_layers


def plan_v41_application(name: str, args: AppArgs, model_cfg: Mapping[str, Any],
                         version: str, reserve_gib: float) -> ReplicaPlan | None:
    """DeepSeek-V4.1's plan from its own byte model, per node type.

    None when a declared node cannot run V4.1 at all (the V4 plan then carries the
    ``v41-node`` refusal). The engine's ``kv_cache_dtype`` is the user's: dsv4_patch
    leaves V4.1 to vLLM 0.30+'s own resolver.
    """
    weights = estimate_weights(model_cfg)
    try:
        nodes = [v41_node_capacity(args, spec, model_cfg, version, weights, reserve_gib)
                 for spec in args.dsv4.nodes().values()]
    except (rules.LayoutError, rules.KVCacheDtypeError):
        return None
    declared = node_type_key(args.dsv4.node.model_dump(mode="json"))
    main = next(n for n in nodes if n.node_type == declared)
    ek = args.llm.engine_kwargs
    plan = ReplicaPlan(
        application=name, model=plan_model(args), node=main.node,
        parallel=args.parallel().as_dict(), vllm_version=version, layout=main.layout,
        backend=main.backend, layout_reason=main.numerics,
        expected_layout=main.expected_layout, kv_cache_dtype=ek.kv_cache_dtype,
        engine_kv_cache_dtype=ek.kv_cache_dtype, cache_dtype_str=main.cache_dtype_str,
        resolution_reason=f"DeepSeek-V4.1 on {main.backend}: vLLM's own resolver",
        block_size=main.block_size,
        max_model_len=engine_extra(args, "max_model_len",
                                    model_cfg.get("max_position_embeddings")),
        weights_total_bytes=weights.total, parameters=weights.parameters,
        capacity=main.capacity, family=rules.Family.V41.value, node_capacities=nodes,
        mix=mix_summary(nodes))
    par = args.parallel()
    if par.dp > 1:
        as_tp = Parallel(par.tp * par.dp, par.pp, 1, par.ep, par.nodes)
        try:
            plan.tp_alternative = v41_node_capacity(args, args.dsv4.node, model_cfg, version,
                                                    weights, reserve_gib, as_tp).capacity
        except (rules.LayoutError, rules.KVCacheDtypeError):
            plan.tp_alternative = None
    if hasattr(args, "pd"):  # a PDAppArgs
        plan.pd = pd_plan.summary(args, main.capacity.kv_bytes_per_token, main.block_size,
                                  main.capacity.kv_tokens_per_replica, plan.max_model_len,
                                  version)
    shape = rules.ModelShape.from_hf_config(model_cfg)
    policy = [p for p in checks.check(args)
              if p.code not in checks.UNPLANNABLE | {"layout-contradicts-expectation"}]
    found = [*policy, *_v41_layout_problems(nodes), *_capacity_problems(plan, args),
             *_override_problems(plan, args, shape), *v41_problems(args, model_cfg, version),
             *pd_plan.problems(plan.pd), *pd_plan.region_dedup_findings(plan.pd)]
    plan.problems = sorted(found, key=lambda p: p.severity != "error")
    return plan


def mix_summary(nodes: Sequence[NodeCapacity]) -> dict[str, Any] | None:
    """Several node types: each one's share of bytes and tokens, against the first.

    What an operator weighs when choosing the mix: one replica of each type holds
    ``tokens_per_replica`` context tokens; the ratios say how much more one holds.
    """
    if len(nodes) < 2:
        return None
    base = nodes[0]
    rows = []
    for n in nodes:
        cap, ref = n.capacity, base.capacity
        tokens_ratio = (cap.kv_tokens_per_replica / ref.kv_tokens_per_replica
                        if cap.kv_tokens_per_replica is not None and ref.kv_tokens_per_replica
                        else None)
        rows.append({"node_type": n.node_type, "layout": n.layout,
                     "kv_bytes_per_token": cap.kv_bytes_per_token,
                     "kv_tokens_per_replica": cap.kv_tokens_per_replica,
                     "bytes_per_token_ratio": cap.kv_bytes_per_token / ref.kv_bytes_per_token,
                     "tokens_per_replica_ratio": tokens_ratio})
    return {"reference": base.node_type, "node_types": rows,
            "groups": len({(n.layout, n.block_size, n.capacity.kv_bytes_per_token)
                           for n in nodes})}


def _v41_layout_problems(nodes: Sequence[NodeCapacity]) -> list[Finding]:
    """A node type whose V4.1 record contradicts its expected layout would refuse to start."""
    return [Finding("error", "layout-contradicts-expectation", (
        f"DeepSeek-V4.1 on {n.node_type} ({capability_text(n.node)}, {n.backend}) stores "
        f"{n.layout} ({n.capacity.kv_bytes_per_token:g} B per context token, {n.numerics}) "
        f"but dsv4 expects {n.expected_layout} there: such replicas refuse to start. Fix: "
        f"set expected_layouts: {{{n.node_type}: {n.layout}}}, or change the node's "
        "attention_backend / kv_cache_dtype.")) for n in nodes if n.layout != n.expected_layout]

V41_STACK_FIX = ("install a V4.1 stack (pip install 'dsv4-serve[gpu-v41]': ray[serve] 2.60.0 "
                 "over vllm 0.33.0, or the image build arg DSV4_EXTRA=gpu-v41-034: vllm "
                 "0.34.0) and plan with --vllm-version 0.33.0 or 0.34.0")


def v41_problems(args: AppArgs, model_cfg: Mapping[str, Any], version: str) -> list[Finding]:
    """DeepSeek-V4.1 refusals: a stack without V4.1, P/D pools whose nodes write other bytes."""
    found = []
    if rules.parse_version(version)[:2] < rules.FIRST_V41_VLLM:
        found.append(Finding("error", "v41-needs-vllm-030", (
            f"model {plan_model(args)} is DeepSeek-V4.1 (DeepseekV41ForCausalLM) but the "
            f"planned stack runs vLLM {version}, which has no V4.1 (first: 0.30; ray[llm] "
            f"2.60.0 pins vllm 0.29.0). Fix: {V41_STACK_FIX}.")))
        return found
    for key, node in args.dsv4.nodes().items():
        where = "dsv4.node" if node == args.dsv4.node else f"dsv4.node_types.{key}"
        try:
            rules.build(node_setup(args, node, version), model_cfg)
        except (rules.LayoutError, rules.KVCacheDtypeError) as exc:
            found.append(Finding("error", "v41-node", f"{where}: {exc}"))
    if hasattr(args, "pd"):
        found += _pd_node_problems(args, model_cfg, version)
    return found


def plan_model(args: AppArgs) -> str:
    loading = args.llm.model_loading_config
    return str(loading.model_source or loading.model_id)


def _pd_node_problems(args: Any, model_cfg: Mapping[str, Any], version: str) -> list[Finding]:
    """Each pool's record on its own node under its own vLLM (``pd.<pool>.vllm_version``)."""
    prefill, decode = args.pool_node("prefill"), args.pool_node("decode")
    requested = args.llm.engine_kwargs.kv_cache_dtype
    releases = [args.pool_vllm_version(pool, version) or version
                for pool in ("prefill", "decode")]
    mine, theirs = (node_record_fields(model_cfg, node.model_dump(mode="json"), requested,
                                       release)
                    for node, release in zip((prefill, decode), releases, strict=True))
    diffs = [(f, mine[f], theirs[f]) for f in mine if mine[f] != theirs[f]]
    if not diffs:
        return []
    named = "; ".join(f"{f}: prefill {p!r}, decode {d!r}" for f, p, d in diffs)
    return [Finding("error", "pd-node-record", (
        f"P/D pools write other KV bytes (prefill node {prefill.platform} "
        f"{prefill.compute_capability} on vLLM {releases[0]}, decode node "
        f"{decode.platform} {decode.compute_capability} on vLLM {releases[1]}): {named}. "
        "NIXL's handshake compares dtype and backend names only, so pages would be copied "
        "and decoded as garbage. Fix: put both pools on one GPU type and one vLLM release "
        "(V4.1's record is per GPU: no default setting makes SM90 and SM100 write the "
        "same bytes), or serve each GPU type as its own aggregated app."))]


