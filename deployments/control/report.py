"""The KV-spec verdict in a few lines, for people: ``dsv4-serve status`` and ``run`` print it."""

from __future__ import annotations

from deployments.control.wire import FleetReport
from deployments.logs import get_logger

logger = get_logger("controller")


def describe(report: FleetReport) -> str:
    """The verdict in a few lines, for people: state, reference, each replica, problems."""
    age = f", {report.age_s:.0f} s old" if report.age_s is not None else ""
    head = (f"KV spec: {report.state.value}"
            + (f" (last completed check: {report.previous_state.value})"
               if report.previous_state else "")
            + f" (policy {report.policy}"
            + (" by operator override" if report.policy_override else "")
            + f", expected {report.expected.layout}, reference "
              f"{report.expected.reference}{age}); {report.answered}/"
              f"{report.running_replicas} replicas answered")
    lines = [head]
    if report.expected.note:
        lines.append(f"  note: {report.expected.note}")
    for rep in report.replicas:
        if rep.fingerprint is None:
            lines.append(f"  {rep.id}: [{rep.status.value}] {rep.reason or ''}")
            continue
        action = "" if rep.action.value == "serve" else f", action {rep.action.value}"
        pool = f"{rep.pool} " if rep.pool else ""
        node_type = f" ({rep.node_type})" if rep.node_type else ""
        lines.append(f"  {pool}{rep.id} rank {rep.rank} on node {rep.node_id}{node_type}: "
                     f"{rep.cache_dtype}, blocks "
                     f"{rep.block_sizes}, pages {rep.page_sizes} B, {rep.fingerprint[:19]} "
                     f"[{rep.status.value}{action}]")
    lines += describe_capacity(report)
    lines += describe_pd(report)
    lines += [f"  problem: {p.message}" for p in report.problems]
    return "\n".join(lines)


def describe_capacity(report: FleetReport) -> list[str]:
    """KV capacity per node type as ``dsv4-serve plan`` computes it, and replicas on each."""
    plan = report.kv_capacity
    if plan is None:
        return []
    if not plan.nodes:
        return [f"  KV capacity: unknown ({plan.reason})"] if plan.reason else []
    lines = ["  KV capacity per node type (dsv4-serve plan; vLLM's cache_config_info "
             "block_size is the minimum over DSv4's cache groups, vllm#51163):"]
    for n in plan.nodes:
        on = sum(r.node_type == n.node_type for r in report.replicas)
        tokens = (f"{n.kv_tokens_per_engine:,} tokens per engine, {n.kv_tokens_per_replica:,} "
                  "per replica" if n.kv_tokens_per_engine is not None
                  else "tokens unknown (no memory declared for the node)")
        lines.append(f"    {n.node_type}: {n.storage}, block {n.block_size}, "
                     f"{n.kv_bytes_per_token:,.2f} B/token per GPU, {tokens}; {on} replica(s)")
    return lines


def describe_pd(report: FleetReport) -> list[str]:
    """The P/D verdict: each pool's state, then which prefill replicas each decode uses."""
    pd = report.pd
    if pd is None:
        return []
    pools = ", ".join(f"{name} {p.deployment} {p.state.value} ({len(p.replicas)} answered)"
                      for name, p in pd.pools.items())
    lines = [f"  P/D: {pd.verdict.value}; pools: {pools or 'none checked'}"]
    lines += [f"    decode {d} takes KV from prefill {ids or 'none (prefills locally)'}"
              + _shown(pd.failed_kv_transfers.get(d), "; {} failed KV transfer(s) counted")
              for d, ids in pd.allowed.items()]
    for c in pd.canaries:
        head = (f"    canary decode {c.decode_replica} <- prefill {c.prefill_replica}: "
                f"{'passed' if c.passed else 'FAILED (pair excluded)'} ({c.mode.value}, "
                f"max logprob delta {_shown(c.max_delta, '{:.3f}', 'n/a')} of {c.tolerance:g}, "
                f"median {_shown(c.median_delta, '{:.3f}', 'n/a')}"
                f"{_shown(c.median_tolerance, ' of {:g}')}, "
                f"{c.external_tokens}/{c.prompt_tokens} prompt tokens over the connector, "
                f"{c.seconds:.1f} s)")
        lines.append(head if c.passed and not c.reason else f"{head}: {c.reason}"
                     + ("" if c.passed else f"; deltas {[round(d, 3) for d in c.deltas]}, "
                        f"tokens {c.tokens}"))
    return lines


def _shown(value: float | None, spec: str, missing: str = "") -> str:
    """``spec`` filled with ``value``, or ``missing`` when there is none."""
    return missing if value is None else spec.format(value)


def log_change(prev: FleetReport, report: FleetReport) -> None:
    """Log the verdict when its state or its odd replicas changed since ``prev``."""
    if (prev.state, sorted(prev.odd_replicas.items())) == (
            report.state, sorted(report.odd_replicas.items())):
        return
    log = logger.info if report.agree else logger.warning
    log("dsv4: KV spec %s: %d/%s replicas answered, reference %s; %s", report.state.value,
        report.answered, report.running_replicas, report.expected.reference,
        "; ".join(p.message for p in report.problems) or "one fingerprint, as predicted")
