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

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deployments.config import (
    AppArgs,
    NodeSpec,
    Policy,
    checks,
    load_serve_config,
    refuse_problems,
)
from deployments.config.checks import Problem
from deployments.config.dsv4 import node_type_key
from deployments.config.sizing import Parallel
from deployments.control.prediction import pool_node_differences
from deployments.plan import pd as pd_plan
from deployments.plan.capacity import GIB, Capacity, capacity, engine_extra, v41_capacity
from deployments.plan.model_configs import find_model_config
from deployments.plan.weights import WeightEstimate, estimate_weights
from dsv4_patch import rules


@dataclass
class NodeCapacity:
    """One node type of an application: what its replicas store and hold.

    A mixed fleet (``dsv4.node_types``) has one per GPU type; DeepSeek-V4.1 writes
    other bytes on each (``rules.v41_record``), so capacity is per type, not per app.
    """

    node_type: str  # the expected_layouts key: sm90, sm100, ...
    node: dict[str, Any]
    layout: str  # fp8_ds_mla | nvfp4_ds_mla | plain_rows
    expected_layout: str
    backend: str
    cache_dtype_str: str
    block_size: int
    numerics: str
    capacity: Capacity


@dataclass
class ReplicaPlan:
    """Everything ``plan`` knows about one application's replicas."""

    application: str
    model: str
    node: dict[str, Any]
    parallel: dict[str, Any]
    vllm_version: str
    layout: str
    backend: str
    layout_reason: str
    expected_layout: str
    kv_cache_dtype: str
    engine_kv_cache_dtype: str
    cache_dtype_str: str
    resolution_reason: str
    block_size: int
    max_model_len: int | None
    weights_total_bytes: float
    parameters: int
    capacity: Capacity
    fp8_ds_mla_capacity: Capacity | None = None  # the counterfactual, when rows
    # DP presets: the same GPUs as one tensor-parallel engine (KV replicated per rank)
    tp_alternative: Capacity | None = None
    pd: dict[str, Any] | None = None  # P/D apps: deployments.plan.pd.summary
    family: str = rules.Family.V4.value
    # Every node type's capacity (one entry unless dsv4.node_types lists several).
    node_capacities: list[NodeCapacity] = field(default_factory=list)
    mix: dict[str, Any] | None = None  # several node types: ratios between them
    problems: list[Problem] = field(default_factory=list)

    @property
    def refused(self) -> bool:
        return any(p.severity == "error" for p in self.problems)


def plan_application(name: str, args: AppArgs, model_cfg: Mapping[str, Any], *,
                     vllm_version: str | None = None,
                     reserve_gib: float = 0.0) -> ReplicaPlan:
    """Plan one application's replicas on its declared node (each node type of a mixed fleet)."""
    node, ek = args.dsv4.node, args.llm.engine_kwargs
    version = vllm_version or args.dsv4.vllm_version or rules.DEFAULT_VLLM[node.platform]
    if rules.family_of(model_cfg) is rules.Family.V41:
        v41 = plan_v41_application(name, args, model_cfg, version, reserve_gib)
        if v41 is not None:
            return v41
    decision = args.predicted_layout(version)
    resolution = rules.resolve_kv_cache_dtype(decision.layout, ek.kv_cache_dtype)
    shape = rules.ModelShape.from_hf_config(model_cfg)
    weights = estimate_weights(model_cfg)
    block = args.block_size()
    cap = capacity(args, shape, weights, resolution.storage, block, reserve_gib)
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
                                            block, reserve_gib)
    par = args.parallel()
    if par.dp > 1:
        as_tp = Parallel(par.tp * par.dp, par.pp, 1, par.ep, par.nodes)
        plan.tp_alternative = capacity(args, shape, weights, resolution.storage, block,
                                       reserve_gib, as_tp)
    if hasattr(args, "pd"):  # a PDAppArgs
        plan.pd = pd_plan.summary(args, cap.kv_bytes_per_token, block,
                                  cap.kv_tokens_per_replica, plan.max_model_len)
    plan.node_capacities = [
        NodeCapacity(key, spec.model_dump(mode="json"), plan.layout,
                     args.dsv4.expected_for(spec.model_dump(mode="json")), plan.backend,
                     plan.cache_dtype_str, block, resolution.reason,
                     cap if spec == node else capacity(args, shape, weights, resolution.storage,
                                                       block, reserve_gib, node=spec))
        for key, spec in args.dsv4.nodes().items()]
    plan.mix = mix_summary(plan.node_capacities)
    plan.problems = find_problems(plan, args, shape)
    if rules.family_of(model_cfg) is rules.Family.V41:  # a node V4.1 cannot run on
        plan.problems = sorted(v41_problems(args, model_cfg, version) + plan.problems,
                               key=lambda p: p.severity != "error")
    return plan


def v41_node_capacity(args: AppArgs, spec: NodeSpec, topo: rules.V41Topology,
                      weights: WeightEstimate, reserve_gib: float,
                      par: Parallel | None = None) -> NodeCapacity:
    """DeepSeek-V4.1 on one node type: its record (``rules.v41_record``) and tokens.

    Raises ``rules.LayoutError`` / ``rules.KVCacheDtypeError`` where V4.1 cannot run.
    """
    ek = args.llm.engine_kwargs
    backend = ek.attention_backend or spec.attention_backend
    record = rules.v41_record(spec.platform, spec.compute_capability, backend,
                              ek.kv_cache_dtype, ek.block_size)
    node = spec.model_dump(mode="json")
    return NodeCapacity(
        node_type=node_type_key(node), node=node,
        layout=record.cache_dtype_str if record.packed else "plain_rows",
        expected_layout=args.dsv4.expected_for(node), backend=record.backend,
        cache_dtype_str=record.cache_dtype_str, block_size=record.block_size,
        numerics=record.numerics,
        capacity=v41_capacity(args, topo, record, weights, reserve_gib, spec, par))


def plan_v41_application(name: str, args: AppArgs, model_cfg: Mapping[str, Any],
                         version: str, reserve_gib: float) -> ReplicaPlan | None:
    """DeepSeek-V4.1's plan from its own byte model, per node type.

    None when a declared node cannot run V4.1 at all (the V4 plan then carries the
    ``v41-node`` refusal). The engine's ``kv_cache_dtype`` is the user's: dsv4_patch
    leaves V4.1 to vLLM 0.30+'s own resolver.
    """
    topo = rules.V41Topology.from_hf_config(model_cfg)
    weights = estimate_weights(model_cfg)
    try:
        nodes = [v41_node_capacity(args, spec, topo, weights, reserve_gib)
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
        plan.tp_alternative = v41_node_capacity(args, args.dsv4.node, topo, weights,
                                                reserve_gib, as_tp).capacity
    if hasattr(args, "pd"):  # a PDAppArgs
        plan.pd = pd_plan.summary(args, main.capacity.kv_bytes_per_token, main.block_size,
                                  main.capacity.kv_tokens_per_replica, plan.max_model_len)
    shape = rules.ModelShape.from_hf_config(model_cfg)
    policy = [p for p in checks.check(args)
              if p.code not in checks.UNPLANNABLE | {"layout-contradicts-expectation"}]
    found = [*policy, *_v41_layout_problems(nodes), *_capacity_problems(plan, args),
             *_override_problems(plan, args, shape), *v41_problems(args, model_cfg, version)]
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


def _v41_layout_problems(nodes: Sequence[NodeCapacity]) -> list[Problem]:
    """A node type whose V4.1 record contradicts its expected layout would refuse to start."""
    return [Problem("error", "layout-contradicts-expectation", (
        f"DeepSeek-V4.1 on {n.node_type} ({capability_text(n.node)}, {n.backend}) stores "
        f"{n.layout} ({n.capacity.kv_bytes_per_token:g} B per context token, {n.numerics}) "
        f"but dsv4 expects {n.expected_layout} there: such replicas refuse to start. Fix: "
        f"set expected_layouts: {{{n.node_type}: {n.layout}}}, or change the node's "
        "attention_backend / kv_cache_dtype.")) for n in nodes if n.layout != n.expected_layout]


V41_STACK_FIX = ("install the V4.1 stack (pip install 'dsv4-serve[gpu-v41]': ray[llm] 2.60.0 "
                 "over vllm 0.33.0; image build arg DSV4_EXTRA=gpu-v41) and plan with "
                 "--vllm-version 0.33.0")


def v41_problems(args: AppArgs, model_cfg: Mapping[str, Any], version: str) -> list[Problem]:
    """DeepSeek-V4.1 refusals: a stack without V4.1, P/D pools whose nodes write other bytes."""
    found = []
    if rules.parse_version(version)[:2] < rules.FIRST_V41_VLLM:
        found.append(Problem("error", "v41-needs-vllm-030", (
            f"model {plan_model(args)} is DeepSeek-V4.1 (DeepseekV41ForCausalLM) but the "
            f"planned stack runs vLLM {version}, which has no V4.1 (first: 0.30; ray[llm] "
            f"2.60.0 pins vllm 0.29.0). Fix: {V41_STACK_FIX}.")))
        return found
    for key, node in args.dsv4.nodes().items():
        where = "dsv4.node" if node == args.dsv4.node else f"dsv4.node_types.{key}"
        try:
            rules.v41_record(node.platform, node.compute_capability,
                             args.llm.engine_kwargs.attention_backend or node.attention_backend,
                             args.llm.engine_kwargs.kv_cache_dtype)
        except (rules.LayoutError, rules.KVCacheDtypeError) as exc:
            found.append(Problem("error", "v41-node", f"{where}: {exc}"))
    if hasattr(args, "pd"):
        found += _pd_node_problems(args, model_cfg, version)
    return found


def plan_model(args: AppArgs) -> str:
    loading = args.llm.model_loading_config
    return str(loading.model_source or loading.model_id)


def _pd_node_problems(args: Any, model_cfg: Mapping[str, Any], version: str) -> list[Problem]:
    prefill, decode = args.pool_node("prefill"), args.pool_node("decode")
    diffs = pool_node_differences(model_cfg, prefill.model_dump(mode="json"),
                                  decode.model_dump(mode="json"),
                                  args.llm.engine_kwargs.kv_cache_dtype, version)
    if not diffs:
        return []
    named = "; ".join(f"{f}: prefill {p!r}, decode {d!r}" for f, p, d in diffs)
    return [Problem("error", "pd-node-record", (
        f"P/D pools on other GPU types write other KV bytes (prefill node "
        f"{prefill.platform} {prefill.compute_capability}, decode node {decode.platform} "
        f"{decode.compute_capability}): {named}. NIXL's handshake compares dtype and "
        "backend names only, so pages would be copied and decoded as garbage. Fix: put "
        "both pools on one GPU type (V4.1's record is per GPU: no default setting makes "
        "SM90 and SM100 write the same bytes), or serve each GPU type as its own "
        "aggregated app."))]


# ------------------------------------------------------------------ problems


def find_problems(plan: ReplicaPlan, args: AppArgs, shape: rules.ModelShape) -> list[Problem]:
    """Every problem of one application, errors first."""
    # The policy rules, except the layout contradiction: planned below, with its cost.
    policy = [p for p in checks.check(args)
              if p.code not in checks.UNPLANNABLE | {"layout-contradicts-expectation"}]
    found = [
        *policy,
        *_layout_problems(plan),
        *_stock_crash(plan),
        *_capacity_problems(plan, args),
        *_override_problems(plan, args, shape),
    ]
    return sorted(found, key=lambda p: p.severity != "error")


def _layout_problems(plan: ReplicaPlan) -> list[Problem]:
    if plan.layout == plan.expected_layout:
        return []
    cap, alt = plan.capacity, plan.fp8_ds_mla_capacity
    msg = (
        f"expected_layout={plan.expected_layout} but this node ({capability_text(plan.node)}, "
        f"backend {plan.backend}) stores "
        f"{plan.layout}: kv_cache_dtype={plan.kv_cache_dtype} becomes {cap.storage}, "
        f"{cap.kv_bytes_per_token:g} B per context token"
    )
    if alt is not None:
        msg += (f" instead of {alt.kv_bytes_per_token:g} B on fp8_ds_mla "
                f"({cap.kv_bytes_per_token / alt.kv_bytes_per_token:.2f}x)")
        if cap.kv_tokens_per_replica is not None and alt.kv_tokens_per_replica:
            change = cap.kv_tokens_per_replica / alt.kv_tokens_per_replica - 1
            msg += (f"; KV tokens per replica {cap.kv_tokens_per_replica:,} instead of "
                    f"{alt.kv_tokens_per_replica:,} ({change:+.1%})")
    msg += (". Such replicas refuse to start under this expectation, and a fleet mixing "
            "them with fp8_ds_mla replicas would run different page layouts and numerics. "
            "Fix: unset attention_backend (FlashMLA stores fp8_ds_mla), or set "
            f"expected_layout: {plan.layout} for a fleet that is entirely this node type.")
    return [Problem("error", "layout-contradicts-expectation", msg)]


def _stock_crash(plan: ReplicaPlan) -> list[Problem]:
    layout = rules.Layout(plan.layout)
    if not rules.stock_vllm_crashes_on(plan.vllm_version, layout, plan.kv_cache_dtype):
        return []
    return [Problem(
        "warning", "stock-vllm-crash",
        f"stock vLLM {plan.vllm_version} (0.20-0.29 assert 'DeepseekV4 fp8_ds_mla layout "
        "only supports fp8 kv-cache, got auto', vllm-project/vllm#47174) would crash "
        f"building layers with kv_cache_dtype={plan.kv_cache_dtype} on {plan.layout}. "
        "dsv4_patch's vLLM plugin makes every vLLM process that loads it decide like "
        "vLLM 0.30+ (auto -> fp8_ds_mla; checked on the real code of 0.20.0-0.33.0, "
        "docs/versions.md: the resolver patch on 0.23-0.29, the layer __init__ hook on "
        "0.20-0.22); it must be installed on every node (the serving image in "
        "Dockerfile installs it) and allowed by VLLM_PLUGINS.",
    )]


def _capacity_problems(plan: ReplicaPlan, args: AppArgs) -> list[Problem]:
    cap, found = plan.capacity, []
    node = args.dsv4.node
    if node.platform != "cpu" and node.gpu_memory_gib is None:
        found.append(Problem("warning", "capacity-unknown",
                             "dsv4.node.gpu_memory_gib is not set, so KV capacity is not "
                             "estimated. Fix: set it to the GPU memory nvidia-smi reports."))
    if cap.kv_budget_per_gpu_bytes is not None and cap.kv_budget_per_gpu_bytes <= 0:
        found.append(Problem(
            "error", "weights-do-not-fit",
            f"weights need {cap.weights_per_gpu_bytes / GIB:.1f} GiB per GPU, more than "
            "gpu_memory_gib x gpu_memory_utilization leaves. Fix: more GPUs per replica "
            "(tensor/pipeline/expert parallel) or larger GPUs."))
    tokens, limit = cap.kv_tokens_per_engine, plan.max_model_len
    if tokens is not None and limit and tokens < limit:
        found.append(Problem(
            "error", "max-model-len-does-not-fit",
            f"max_model_len={limit} but one engine's KV pool holds {tokens:,} tokens: a "
            "full-length request cannot be scheduled. Fix: lower max_model_len or add "
            "memory per engine."))
    room = (node.gpus_per_node or 0) * node.nodes_per_replica
    # A P/D app's prefill and decode replica share a node (deployments.plan.pd).
    idle = room - int(plan.parallel["gpus_per_replica"]) * (2 if plan.pd else 1)
    if node.platform != "cpu" and node.gpus_per_node and idle > 0:
        found.append(Problem(
            "warning", "idle-gpus",
            f"a replica uses {plan.parallel['gpus_per_replica']} of the "
            f"{node.gpus_per_node * node.nodes_per_replica} GPUs of its node(s); {idle} "
            "stay idle unless another deployment fills them."))
    return found


def _override_problems(plan: ReplicaPlan, args: AppArgs,
                       shape: rules.ModelShape) -> list[Problem]:
    """Replica overrides that change the page spec make replicas disagree."""
    found = []
    severity = "error" if args.dsv4.policy is Policy.ENFORCE else "warning"
    for override in args.dsv4.replica_overrides:
        ek = override.engine_kwargs
        diffs = []
        block = ek.get("block_size", plan.block_size)
        if block != plan.block_size:
            diffs.append(f"block_size {block} vs {plan.block_size}")
        backend = ek.get("attention_backend")
        if backend:
            node = args.dsv4.node
            other = rules.detect_layout(node.platform, node.compute_capability, backend,
                                        plan.vllm_version)
            if other.layout.value != plan.layout:
                diffs.append(f"layout {other.layout.value} vs {plan.layout}")
        if diffs:
            consequence = ("the KV-spec controller fails its health check"
                           if severity == "error" else "the controller reports it")
            found.append(Problem(
                severity, "replicas-disagree",
                f"replica rank {override.rank} ({override.reason}) would disagree with the "
                f"fleet: {', '.join(diffs)}; {consequence}."))
    return found


def fleet_problems(plans: Sequence[ReplicaPlan]) -> list[Problem]:
    """Applications serving the same model with different page specs would disagree."""
    found, by_model = [], {}
    for plan in plans:
        by_model.setdefault(plan.model, []).append(plan)
    for model, group in by_model.items():
        specs = {(p.capacity.storage, p.block_size) for p in group}
        if len(specs) > 1:
            detail = "; ".join(f"{p.application}: {p.capacity.storage}, block {p.block_size}"
                               for p in group)
            found.append(Problem(
                "error", "replicas-disagree",
                f"{model} is served with different KV page specs ({detail}): clients and "
                "P/D transfers would see different layouts. Fix: one layout per model."))
    return found


# ------------------------------------------------------------------ whole config


@dataclass
class PlanReport:
    config: str
    applications: list[ReplicaPlan]
    problems: list[Problem]

    @property
    def refused(self) -> bool:
        return any(p.severity == "error" for p in self.problems) or any(
            a.refused for a in self.applications)

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "refused": self.refused,
                "applications": [asdict(a) | {"refused": a.refused} for a in self.applications],
                "problems": [asdict(p) for p in self.problems]}


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


def capability_text(node: Mapping[str, Any]) -> str:
    """``sm 9.0`` for a node dict with a compute capability, else empty."""
    cap = node.get("compute_capability")
    return f"sm {cap[0]}.{cap[1]}" if cap else ""
