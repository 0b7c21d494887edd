"""``dsv4-serve plan CONFIG``: the plan of ``deployments.plan.preflight`` as a table or JSON.

Exit status: 0 when the config plans cleanly, 1 when it is refused, 2 when it is
invalid (``deployments.config.ConfigError``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deployments.config import ConfigError
from deployments.plan import pd
from deployments.plan.capacity import GIB
from deployments.plan.preflight import PlanReport, ReplicaPlan, capability_text, plan_config


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:,.1f} GiB"


def _tokens(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _node_row(plan: ReplicaPlan) -> str:
    node, nodes = plan.node, plan.parallel["nodes_per_replica"]
    if node["platform"] == "cpu":
        return f"cpu, {nodes} node(s)/replica"
    return (f"{node['platform']} {capability_text(node)}, "
            f"{node.get('gpus_per_node') or '?'} GPUs x "
            f"{node.get('gpu_memory_gib') or '?'} GiB, {nodes} node(s)/replica")


def table_rows(plan: ReplicaPlan) -> list[tuple[str, str]]:
    """The plain-table rows of one application."""
    par, cap = plan.parallel, plan.capacity
    unit = "workers" if plan.node["platform"] == "cpu" else "GPUs"
    rows = [
        ("model", plan.model),
        ("node", _node_row(plan)),
        ("parallel", f"TP{par['tensor_parallel_size']} PP{par['pipeline_parallel_size']} "
                     f"DP{par['data_parallel_size']} EP{par['expert_parallel_size']}: "
                     f"{par['engines_per_replica']} engine(s), {par['gpus_per_replica']} "
                     f"{unit} per replica"),
        ("layout", f"{plan.layout} ({plan.backend}; expected {plan.expected_layout})"),
        ("kv_cache_dtype", f"{plan.kv_cache_dtype} -> engine {plan.engine_kv_cache_dtype} -> "
                           f"{plan.cache_dtype_str} ({cap.storage})"),
        ("stock vLLM", plan.vllm_version),
        ("KV bytes/token", f"{cap.kv_bytes_per_token:g} (fullest PP stage per GPU: "
                           f"{cap.kv_bytes_per_token_per_gpu:g}; block {plan.block_size})"),
        ("weights", f"{plan.weights_total_bytes / 1e9:,.1f} GB total "
                    f"({plan.parameters / 1e9:,.1f} B params), "
                    f"{_gib(cap.weights_per_gpu_bytes)} per GPU"),
        ("KV budget/GPU", _gib(cap.kv_budget_per_gpu_bytes)),
        ("KV tokens/engine", _tokens(cap.kv_tokens_per_engine)),
        ("KV tokens/replica", _tokens(cap.kv_tokens_per_replica)),
        ("max_model_len", _tokens(plan.max_model_len)),
    ]
    alt = plan.tp_alternative
    if alt is not None and alt.kv_tokens_per_replica and cap.kv_tokens_per_replica is not None:
        gain = cap.kv_tokens_per_replica / alt.kv_tokens_per_replica
        rows.append((f"  as TP{par['gpus_per_replica'] // par['pipeline_parallel_size']}",
                     f"{_tokens(alt.kv_tokens_per_replica)} tokens/replica (KV replicated "
                     f"on every rank): DP gives {gain:.2f}x"))
    if plan.fp8_ds_mla_capacity is not None:
        rows.append(("  on fp8_ds_mla", _tokens(plan.fp8_ds_mla_capacity.kv_tokens_per_replica)
                     + " tokens/replica"))
    return rows + node_rows(plan) + pd.rows(plan.pd)


def node_rows(plan: ReplicaPlan) -> list[tuple[str, str]]:
    """Each node type's capacity (DeepSeek-V4.1, or a mixed fleet) and the mix between them.

    V4.1 writes other bytes per GPU type (``dsv4_patch.rules.v41_record``): a mixed
    fleet's replicas hold different numbers of tokens, and the controller reports
    them as one conforming group per type.
    """
    nodes = plan.node_capacities
    if len(nodes) < 2 and plan.family == "deepseek_v4":
        return []
    rows = []
    for n in nodes:
        cap = n.capacity
        rows.append((f"node type {n.node_type}",
                     f"{capability_text(n.node)} {n.node.get('gpu_memory_gib') or '?'} GiB: "
                     f"{n.layout} via {n.backend}, block {n.block_size}, "
                     f"{cap.kv_bytes_per_token:g} KV B/token, "
                     f"{_tokens(cap.kv_tokens_per_engine)} tokens/engine, "
                     f"{_tokens(cap.kv_tokens_per_replica)} tokens/replica "
                     f"(expected {n.expected_layout})"))
    if plan.mix:
        ref = plan.mix["reference"]
        parts = []
        for row in plan.mix["node_types"][1:]:
            tokens = row["tokens_per_replica_ratio"]
            parts.append(f"{row['node_type']}/{ref}: {row['bytes_per_token_ratio']:.2f}x bytes "
                         "per token, " + ("? " if tokens is None else f"{tokens:.2f}x ")
                         + "tokens per replica")
        rows.append(("mix", "; ".join(parts) + f" ({plan.mix['groups']} KV group(s): the "
                     "controller reports one conforming group per node type)"))
    return rows


def render_table(report: PlanReport) -> str:
    """Plain text: one aligned table per application, then its problems."""
    out = [f"plan: {report.config}"]
    for plan in report.applications:
        rows = table_rows(plan)
        width = max(len(k) for k, _ in rows)
        out.append(f"\n[{plan.application}]" + ("  REFUSED" if plan.refused else ""))
        out.extend(f"  {k.ljust(width)}  {v}" for k, v in rows)
        out.extend(f"  {p.severity.upper()} {p.code}: {p.message}" for p in plan.problems)
    out.extend(f"\n{p.severity.upper()} {p.code}: {p.message}" for p in report.problems)
    out.append("\nverdict: " + ("REFUSED" if report.refused else "ok")
               + " (token counts are upper bounds before vLLM's activation profiling;"
               " --reserve-gib subtracts an allowance)")
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path,
                        help="Serve config YAML (e.g. configs/flash-h200.yaml)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--model-config", type=Path, default=None,
                        help="model config.json to use instead of configs/models/<model_source>")
    parser.add_argument("--vllm-version", default=None,
                        help="vLLM the replicas run (default: 0.29.0 on GPU, the ray[llm] pin)")
    parser.add_argument("--reserve-gib", type=float, default=0.0,
                        help="GiB per GPU to set aside for activations/CUDA graphs (default 0)")


def main(args: argparse.Namespace) -> int:
    """Exit 0 when the config plans cleanly, 1 when refused, 2 when it is invalid."""
    try:
        report = plan_config(args.config, model_config=args.model_config,
                             vllm_version=args.vllm_version, reserve_gib=args.reserve_gib)
    except ConfigError as exc:
        print(f"dsv4-serve plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if args.json else render_table(report))
    return 1 if report.refused else 0
