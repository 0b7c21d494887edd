"""The problems ``dsv4-serve plan`` finds in one application's plan, and across a config."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from deployments.config import AppArgs, Policy, checks
from deployments.config.checks import Finding
from deployments.plan import pd as pd_plan
from deployments.plan.capacity import GIB
from deployments.plan.report import ReplicaPlan, capability_text
from dsv4_patch import rules


def find_problems(plan: ReplicaPlan, args: AppArgs, shape: rules.ModelShape) -> list[Finding]:
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
        *pd_plan.problems(plan.pd),
    ]
    return sorted(found, key=lambda p: p.severity != "error")


def _layout_problems(plan: ReplicaPlan) -> list[Finding]:
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
    return [Finding("error", "layout-contradicts-expectation", msg)]


def _stock_crash(plan: ReplicaPlan) -> list[Finding]:
    layout = rules.Layout(plan.layout)
    if not rules.stock_vllm_crashes_on(plan.vllm_version, layout, plan.kv_cache_dtype):
        return []
    return [Finding(
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


def _capacity_problems(plan: ReplicaPlan, args: AppArgs) -> list[Finding]:
    cap, found = plan.capacity, []
    node = args.dsv4.node
    if node.platform != "cpu" and node.gpu_memory_gib is None:
        found.append(Finding("warning", "capacity-unknown",
                             "dsv4.node.gpu_memory_gib is not set, so KV capacity is not "
                             "estimated. Fix: set it to the GPU memory nvidia-smi reports."))
    if cap.kv_budget_per_gpu_bytes is not None and cap.kv_budget_per_gpu_bytes <= 0:
        found.append(Finding(
            "error", "weights-do-not-fit",
            f"weights need {cast(float, cap.weights_per_gpu_bytes) / GIB:.1f} GiB per GPU, "
            "more than gpu_memory_gib x gpu_memory_utilization leaves. Fix: more GPUs per replica "
            "(tensor/pipeline/expert parallel) or larger GPUs."))
    tokens, limit = cap.kv_tokens_per_engine, plan.max_model_len
    if tokens is not None and limit and tokens < limit:
        found.append(Finding(
            "error", "max-model-len-does-not-fit",
            f"max_model_len={limit} but one engine's KV pool holds {tokens:,} tokens: a "
            "full-length request cannot be scheduled. Fix: lower max_model_len or add "
            "memory per engine."))
    room = (node.gpus_per_node or 0) * node.nodes_per_replica
    # A P/D app's prefill and decode replica share a node (deployments.plan.pd).
    idle = room - int(plan.parallel["gpus_per_replica"]) * (2 if plan.pd else 1)
    if node.platform != "cpu" and node.gpus_per_node and idle > 0:
        found.append(Finding(
            "warning", "idle-gpus",
            f"a replica uses {plan.parallel['gpus_per_replica']} of the "
            f"{node.gpus_per_node * node.nodes_per_replica} GPUs of its node(s); {idle} "
            "stay idle unless another deployment fills them."))
    return found


def _override_problems(plan: ReplicaPlan, args: AppArgs,
                       shape: rules.ModelShape) -> list[Finding]:
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
            found.append(Finding(
                severity, "replicas-disagree",
                f"replica rank {override.rank} ({override.reason}) would disagree with the "
                f"fleet: {', '.join(diffs)}; {consequence}."))
    return found


def fleet_problems(plans: Sequence[ReplicaPlan]) -> list[Finding]:
    """Applications serving the same model with different page specs would disagree."""
    found: list[Finding] = []
    by_model: dict[str, Any] = {}
    for plan in plans:
        by_model.setdefault(plan.model, []).append(plan)
    for model, group in by_model.items():
        specs = {(p.capacity.storage, p.block_size) for p in group}
        if len(specs) > 1:
            detail = "; ".join(f"{p.application}: {p.capacity.storage}, block {p.block_size}"
                               for p in group)
            found.append(Finding(
                "error", "replicas-disagree",
                f"{model} is served with different KV page specs ({detail}): clients and "
                "P/D transfers would see different layouts. Fix: one layout per model."))
    return found
