"""The fleet verdict: each replica against its prediction first, against its peers second."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from deployments.control.prediction import (
    describe_differences,
    judge_alone,
    peer_differences,
)
from deployments.control.wire import (
    Expected,
    FleetFinding,
    FleetReport,
    NodeGroup,
    ReplicaRow,
    ReplicaSpec,
    ReplicaStatus,
    State,
)

# ------------------------------------------------------------------ the verdict


@dataclass
class NoAnswer:
    """A RUNNING replica that did not answer in time (``replica`` None when unknown)."""

    replica: str | None
    message: str


def _rank_key(spec: ReplicaSpec) -> tuple[bool, int]:
    return (spec.rank is None, spec.rank or 0)


def majority_reference(group: Sequence[ReplicaSpec]) -> ReplicaSpec:
    """The reference among peers: the most common fingerprint held by a non-canary.

    A canary (a rank with ``replica_overrides``) is never the reference: it
    differs on purpose. Among non-canary fingerprints the most common wins, ties
    to the lowest rank; only a group of canaries alone falls back to all of them.
    """
    voters = [s for s in group if not s.is_canary] or list(group)
    votes = Counter(s.fingerprint for s in group)
    ranked = sorted(voters, key=lambda s: (-votes[s.fingerprint], *_rank_key(s)))
    return ranked[0]


def _judge_peers(group: Sequence[ReplicaSpec]) -> tuple[ReplicaSpec, list[FleetFinding]]:
    ref = majority_reference(group)
    problems = []
    for spec in group:
        if spec.fingerprint == ref.fingerprint:
            continue
        diffs = peer_differences(spec.layers, ref.layers)
        problems.append(FleetFinding(
            kind="mismatch", replica=spec.replica_id,
            field=diffs[0].field if diffs else "layers", layers=diffs,
            message=(f"replica {spec.replica_id} (rank {spec.rank}) differs from its peers "
                     f"(reference replica {ref.replica_id}, rank {ref.rank}) at "
                     f"{len(diffs)} cache(s): {describe_differences(diffs)}")))
    return ref, problems


def decide(specs: Sequence[ReplicaSpec], no_answers: Sequence[NoAnswer], running: int | None,
           expected_layout: str) -> FleetReport:
    """The verdict over the replicas that answered.

    1. Alone: split worker ranks, the replica's own expected layout, and the
       prediction for its deployment's config (main + indexer caches, per layer).
    2. Peers: the replicas that passed and share a prediction must share one
       fingerprint (SWA and compressor-state caches are compared here); without a
       prediction, the majority is the reference (ties against canaries).
    ``disagree`` if anyone is odd; ``incomplete`` if nothing is odd but some
    RUNNING replica did not answer; ``agree`` only when all answered and conform.
    """
    problems: list[FleetFinding] = []
    odd: dict[str, str] = {}
    for spec in specs:
        found = judge_alone(spec)
        if found:
            odd[spec.replica_id] = found[0].message
            problems += found
    groups: dict[str | None, list[ReplicaSpec]] = {}
    for spec in specs:
        if spec.replica_id not in odd:
            groups.setdefault(spec.prediction.fingerprint, []).append(spec)
    refs = []
    for key, group in groups.items():
        ref, found = _judge_peers(group)
        refs.append((key, ref))
        for problem in found:
            odd[problem.replica or ""] = problem.message
        problems += found
    expected = _expected(refs, specs, expected_layout)
    expected.node_groups = node_groups(groups, odd)
    if len(expected.node_groups) > 1:
        expected.note = _mixed_note(expected.node_groups, expected.note)
    for gap in no_answers:
        problems.append(FleetFinding(kind="no_answer", replica=gap.replica, message=gap.message))
    missing = (running or 0) - len(specs) - len(no_answers)
    if missing > 0:
        problems.append(FleetFinding(kind="silent", message=f"{missing} RUNNING replica(s) did "
                                "not answer kv_page_spec"))
    if running == 0 or (running is None and not specs):
        problems.append(FleetFinding(kind="no_replicas", message="no RUNNING replica to compare"))
    if odd:
        state = State.DISAGREE
    elif no_answers or missing > 0 or not specs or running == 0:
        state = State.INCOMPLETE
    else:
        state = State.AGREE
    rows = [_row(s, odd.get(s.replica_id)) for s in sorted(specs, key=_rank_key)]
    rows += [ReplicaRow(id=g.replica, status=ReplicaStatus.NO_ANSWER, reason=g.message)
             for g in no_answers if g.replica]
    return FleetReport(state=state, agree=state is State.AGREE, policy="", expected=expected,
                       running_replicas=running, answered=len(specs), replicas=rows,
                       odd_replicas=odd, problems=problems)


def _expected(refs: Sequence[tuple[str | None, ReplicaSpec]], specs: Sequence[ReplicaSpec],
              layout: str) -> Expected:
    if not refs:
        return Expected(layout=layout, reference="prediction" if specs and all(
            s.prediction.layers is not None for s in specs) else "none")
    predicted = [(k, r) for k, r in refs if k is not None]
    unpredicted = [r for k, r in refs if k is None]
    note = None
    if unpredicted:
        reasons = sorted({r.prediction.reason or "" for r in unpredicted})
        note = ("no prediction for some replicas (" + "; ".join(reasons) + "): those were "
                "judged against the majority of their peers, ties against canaries")
    if len(refs) > 1:
        note = ((note + "; ") if note else "") + (
            f"{len(refs)} deployment configs are live (a rollout?): each replica was "
            "judged against its own config's prediction and its same-config peers")
    main_ref = predicted[0][1] if predicted else unpredicted[0]
    return Expected(layout=layout, fingerprint=main_ref.fingerprint,
                    reference="prediction" if predicted else "majority", note=note)


GIB = 1 << 30


def node_groups(groups: dict[str | None, list[ReplicaSpec]],
                odd: dict[str, str]) -> list[NodeGroup]:
    """The conforming replicas per node type (only predictions made for a node type count).

    Replicas on another GPU generation are judged against their own node's
    prediction (DeepSeek-V4.1's record depends on the GPU); when they conform they
    form a group of their own, never an odd minority.
    """
    out: dict[str, NodeGroup] = {}
    for group in groups.values():
        fine = [s for s in group if s.replica_id not in odd]
        pred = group[0].prediction
        if not fine or pred.node_type is None:
            continue
        per_token = pred.bytes_per_token
        row = out.setdefault(pred.node_type, NodeGroup(
            node_type=pred.node_type, replicas=[], fingerprint=fine[0].fingerprint,
            cache_dtype_str=pred.cache_dtype_str, bytes_per_token=per_token,
            tokens_per_gib=int(GIB // per_token) if per_token else None,
            numerics=pred.numerics))
        row.replicas += [s.replica_id for s in fine]
    return sorted(out.values(), key=lambda g: g.node_type)


def _mixed_note(groups: Sequence[NodeGroup], note: str | None) -> str:
    """Name what differs between conforming node groups: bytes per token, capacity, numerics."""
    parts = [f"{g.node_type}: {len(g.replicas)} replica(s), {g.cache_dtype_str}, "
             f"{g.bytes_per_token:g} B/token ({g.tokens_per_gib} tokens per GiB of KV "
             f"cache), {g.numerics}" for g in groups]
    low, high = min(g.bytes_per_token or 0 for g in groups), \
        max(g.bytes_per_token or 0 for g in groups)
    ratio = f"; capacity differs {high / low:.2f}x per GiB" if low else ""
    text = (f"{len(groups)} node types, each conforming to its own node's prediction "
            f"(not odd; nobody is drained for it): " + " | ".join(parts) + ratio +
            ". Their KV pages cannot move between groups (P/D, migration).")
    return text if not note or "deployment configs are live" in note else f"{note}; {text}"


def _row(spec: ReplicaSpec, reason: str | None) -> ReplicaRow:
    dtypes = spec.cache_dtypes
    return ReplicaRow(
        id=spec.replica_id, rank=spec.rank, node_id=spec.node_id,
        worker_node_ids=spec.worker_node_ids, deployment_version=spec.deployment_version,
        cache_dtype=dtypes[0] if len(dtypes) == 1 else dtypes, cache_dtypes=dtypes,
        block_sizes=spec.block_sizes, page_sizes=spec.page_sizes,
        fingerprint=spec.fingerprint, predicted_fingerprint=spec.prediction.fingerprint,
        kv_cache_dtype_requested=spec.kv_cache_dtype_requested,
        kv_cache_dtype_engine=spec.kv_cache_dtype_engine, versions=spec.versions,
        override=spec.override, policy=spec.policy,
        status=ReplicaStatus.ODD if reason else ReplicaStatus.OK, reason=reason)
