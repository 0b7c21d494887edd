"""KV-spec fingerprints, predictions and the fleet verdict: pure functions, no Ray, no vLLM.

The replica summarizes what its workers report (``dsv4_patch.worker_ext``) and
predicts what they should report (``dsv4_patch.rules`` byte model); the
controller judges each replica against that prediction first and against its
peers second. Both halves live here so they can be tested on recorded data in
milliseconds and so replica and controller never disagree about what "the same
KV spec" means. Messages are the typed models of ``deployments.wire``.

Why an absolute reference: a majority vote names the correct replica whenever
the wrong ones outnumber it (or hold the lower ranks). The prediction comes from
the deployment's own config, so a replica that differs from it is odd even when
it is the majority; peers are only the reference where nothing can be predicted.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from deployments.logs import get_logger
from deployments.wire import (
    DRAIN_STAT,
    Action,
    Expected,
    FleetReport,
    LayerDifference,
    LayerEntry,
    Prediction,
    Problem,
    ReplicaRow,
    ReplicaSpec,
    ReplicaStatus,
    ReplicaVerdict,
    State,
    VerdictMessage,
    WorkerRow,
    WorkerSpec,
)
from dsv4_patch import rules

logger = get_logger("kvspec")

# What makes two caches interchangeable: a request's pages could move between
# them (P/D transfer, migration) layer for layer, and capacity planning holds.
COMPARED = ("spec_type", "cache_dtype_str", "page_size_bytes", "block_size", "head_size",
            "compress_ratio")
# The fields the byte model predicts (main + indexer caches of each layer).
PREDICTED = ("cache_dtype_str", "page_size_bytes", "block_size", "compress_ratio")

# Module suffixes vLLM gives DeepSeek-V4's caches (vllm/models/deepseek_v4/attention.py,
# compressor.py, vLLM 0.30-0.32), most specific first.
_ROLES = ((".indexer.compressor.state_cache", "indexer_compressor_state"),
          (".indexer.k_cache", rules.INDEXER), (".compressor.state_cache", "compressor_state"),
          (".swa_cache", "swa"))
_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
SHOWN_LAYERS = 4  # layer differences spelled out in a message (all are in `layers`)


class KVLayoutMismatch(RuntimeError):
    """A replica's node or workers contradict its config, or enforce names it odd."""


class WorkerSpecError(ValueError):
    """A worker's answer to ``dsv4_kv_specs`` is not what the extension returns."""


def layer_role(name: str) -> tuple[int | None, str]:
    """(decoder layer index, cache role) of a KV-spec layer name."""
    match = _INDEX.search(name)
    index = int(match.group(1)) if match else None
    role = next((r for suffix, r in _ROLES if name.endswith(suffix)), rules.MAIN)
    return index, role


def entry(spec: Mapping[str, Any] | Any) -> LayerEntry:
    """One worker spec row as the per-layer fingerprint entry."""
    row = spec if isinstance(spec, Mapping) else spec.model_dump()
    index, role = layer_role(row["layer"])
    return LayerEntry(layer=row["layer"], index=index, role=role,
                      **{f: row.get(f) for f in COMPARED})


def fingerprint(entries: Iterable[LayerEntry]) -> str:
    """sha256 of the per-layer mapping (layer -> compared fields): equal iff layer for layer."""
    # Attribute reads, not ``model_dump``: the same dicts (so the same hash across
    # versions) at a tenth of the cost; the controller re-hashes every full answer.
    rows = sorted(({"layer": e.layer, **{f: getattr(e, f) for f in COMPARED}}
                   for e in entries), key=lambda r: r["layer"])
    canonical = json.dumps(rows, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def _sort_key(e: LayerEntry) -> tuple[int, str]:
    return (e.index if e.index is not None else -1, e.layer)


def parse_workers(answers: Sequence[Any]) -> list[WorkerSpec]:
    """Validate the workers' answers on receipt; name the first malformed one."""
    if not answers:
        raise WorkerSpecError("no worker answered dsv4_kv_specs; expected one dict per rank")
    workers = []
    for i, answer in enumerate(answers):
        try:
            workers.append(WorkerSpec.model_validate(answer))
        except ValidationError as exc:
            raise WorkerSpecError(
                f"worker answer {i} ({str(answer)[:200]!r}) is not a WorkerSpec: "
                f"{exc.errors(include_url=False)[0]['msg']} at "
                f"{exc.errors(include_url=False)[0]['loc']}; expected the dict returned by "
                "dsv4_patch.worker_ext.DSv4WorkerExtension.dsv4_kv_specs"
            ) from exc
    return workers


@dataclass
class ReplicaKV:
    """One replica's merged KV spec (the part of ``ReplicaSpec`` its workers decide)."""

    layers: list[LayerEntry]
    fingerprint: str
    cache_dtypes: list[str]
    page_sizes: list[int]
    block_sizes: list[int]
    workers: list[WorkerRow]
    ranks_disagreeing: list[int] = field(default_factory=list)

    def fields(self) -> dict[str, Any]:
        return {"layers": self.layers, "fingerprint": self.fingerprint,
                "cache_dtypes": self.cache_dtypes, "page_sizes": self.page_sizes,
                "block_sizes": self.block_sizes, "workers": self.workers,
                "ranks_disagreeing": self.ranks_disagreeing,
                "worker_node_ids": [w.node_id for w in self.workers]}


def summarize_workers(answers: Sequence[Any]) -> ReplicaKV:
    """One replica's KV spec from its workers' answers.

    Tensor-parallel ranks report the same layers, pipeline stages different ones:
    the replica's mapping is the union, and a layer two ranks report differently
    makes those ranks ``ranks_disagreeing`` (vLLM asserts ranks agree; we check,
    because the whole point is not to trust that replicas are alike).
    """
    workers = parse_workers(answers)
    merged: dict[str, LayerEntry] = {}
    split: set[int] = set()
    rows = []
    for worker in workers:
        entries = [entry(s) for s in worker.specs]
        for e in entries:
            first = merged.setdefault(e.layer, e)
            if first != e:
                split.add(worker.rank)
        rows.append(WorkerRow(rank=worker.rank, pid=worker.pid, node_id=worker.node_id,
                              fingerprint=fingerprint(entries),
                              patch_record=worker.patch_record))
    layers = sorted(merged.values(), key=_sort_key)
    return ReplicaKV(
        layers=layers,
        fingerprint=fingerprint(layers),
        cache_dtypes=sorted({e.cache_dtype_str for e in layers if e.cache_dtype_str}),
        page_sizes=sorted({e.page_size_bytes for e in layers if e.page_size_bytes}),
        block_sizes=sorted({e.block_size for e in layers if e.block_size}),
        workers=rows,
        ranks_disagreeing=sorted(split),
    )


# ------------------------------------------------------------------ prediction


def predict(hf_config: Mapping[str, Any] | None, layout: rules.Layout, requested: str | None,
            vllm_version: str | None, source: str) -> Prediction:
    """What the engine will allocate for this config, layout, dtype and vLLM, per layer."""
    if hf_config is None:
        return Prediction(source=source, reason="the model's config.json could not be read")
    why = rules.predictable(hf_config, vllm_version)
    if why:
        return Prediction(source=source, reason=why)
    resolution = rules.resolve_kv_cache_dtype(layout, requested)
    shape = rules.ModelShape.from_hf_config(hf_config)
    layers = [LayerEntry(layer=f"layers.{p.index}.{p.role}", index=p.index, role=p.role,
                         spec_type="MLAAttentionSpec", cache_dtype_str=p.cache_dtype_str,
                         page_size_bytes=p.page_size_bytes, block_size=p.block_size,
                         head_size=None, compress_ratio=p.compress_ratio)
              for p in rules.predict_layers(shape, resolution)]
    return Prediction(source=source, storage=resolution.storage.value,
                      cache_dtype_str=resolution.cache_dtype_str, layers=layers,
                      fingerprint=_prediction_fingerprint(layers))


def _prediction_fingerprint(layers: Sequence[LayerEntry]) -> str:
    rows = [e.model_dump(include={"index", "role", *PREDICTED}) for e in layers]
    canonical = json.dumps(rows, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


_DIFFS: dict[tuple[str, str], list[LayerDifference]] = {}


def replica_vs_prediction(spec_fingerprint: str, layers: Sequence[LayerEntry],
                          prediction: Prediction) -> list[LayerDifference]:
    """``prediction_differences``, memoized by (fingerprint, prediction fingerprint).

    A fleet of N alike replicas then costs one comparison, not N (256 Flash-shaped
    replicas: ~40 ms -> ~2 ms per check).
    """
    key = (spec_fingerprint, prediction.fingerprint or "")
    if key not in _DIFFS:
        if len(_DIFFS) > 1024:
            _DIFFS.clear()
        _DIFFS[key] = prediction_differences(layers, prediction)
    return _DIFFS[key]


def prediction_differences(layers: Sequence[LayerEntry],
                           prediction: Prediction) -> list[LayerDifference]:
    """Where the predicted caches (main + indexer, per layer index) differ from the real ones."""
    assert prediction.layers is not None
    actual = {(e.index, e.role): e for e in layers if e.role in (rules.MAIN, rules.INDEXER)}
    diffs = []
    for want in prediction.layers:
        got = actual.pop((want.index, want.role), None)
        name = f"layers.{want.index} {want.role}"
        if got is None:
            diffs.append(LayerDifference(layer=name, field="present", value=False,
                                         reference=True))
            continue
        diffs += [LayerDifference(layer=got.layer, field=f, value=getattr(got, f),
                                  reference=getattr(want, f))
                  for f in PREDICTED if getattr(got, f) != getattr(want, f)]
    diffs += [LayerDifference(layer=e.layer, field="present", value=True, reference=False)
              for e in actual.values()]
    return diffs


def peer_differences(layers: Sequence[LayerEntry],
                     reference: Sequence[LayerEntry]) -> list[LayerDifference]:
    """Layer for layer (by name), the compared fields where a replica differs from a peer."""
    mine, ref = {e.layer: e for e in layers}, {e.layer: e for e in reference}
    diffs = []
    for name in sorted(mine.keys() | ref.keys(), key=lambda n: (layer_role(n)[0] or -1, n)):
        a, b = mine.get(name), ref.get(name)
        if a is None or b is None:
            diffs.append(LayerDifference(layer=name, field="present", value=a is not None,
                                         reference=b is not None))
            continue
        diffs += [LayerDifference(layer=name, field=f, value=getattr(a, f),
                                  reference=getattr(b, f))
                  for f in COMPARED if getattr(a, f) != getattr(b, f)]
    return diffs


def describe_differences(diffs: Sequence[LayerDifference]) -> str:
    shown = "; ".join(f"{d.layer} {d.field}={d.value} vs {d.reference}"
                      for d in diffs[:SHOWN_LAYERS])
    more = f"; and {len(diffs) - SHOWN_LAYERS} more" if len(diffs) > SHOWN_LAYERS else ""
    return shown + more


def layout_problem(layers: Sequence[LayerEntry], expected_layout: str) -> str | None:
    """Why a replica's specs contradict the expected layout, or None.

    fp8_ds_mla: every attention cache must store the packed record (the specs
    with a cache dtype; state-only specs carry None). plain_rows: none may.
    """
    dtypes = [e.cache_dtype_str for e in layers if e.cache_dtype_str is not None]
    if not dtypes:
        return "no layer reports a cache dtype; expected at least one attention layer"
    packed = [d == "fp8_ds_mla" for d in dtypes]
    if expected_layout == "fp8_ds_mla" and not all(packed):
        bad = sorted({d for d in dtypes if d != "fp8_ds_mla"})
        return f"cache_dtype: expected fp8_ds_mla on every attention layer, found {bad}"
    if expected_layout == "plain_rows" and any(packed):
        return "cache_dtype: expected plain rows, found fp8_ds_mla layers"
    return None


def self_problem(spec: ReplicaSpec) -> str | None:
    """What a replica can tell about itself alone: split ranks, layout, its own prediction.

    Used by the replica before it serves (under enforce it then refuses to start,
    which holds a rolling update back) and by the controller as the first test.
    """
    if spec.ranks_disagreeing:
        return (f"worker ranks {spec.ranks_disagreeing} report other specs than rank "
                f"{spec.workers[0].rank} for the same layers")
    bad = layout_problem(spec.layers, spec.expected_layout)
    if bad:
        return bad
    own = spec.own_prediction or spec.prediction
    if own.layers is not None:
        diffs = prediction_differences(spec.layers, own)
        if diffs:
            return (f"the engine built other KV caches than its own config predicts "
                    f"({own.source}): {describe_differences(diffs)}")
    return None


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


def _odd_against_prediction(spec: ReplicaSpec) -> Problem | None:
    diffs = replica_vs_prediction(spec.fingerprint, spec.layers, spec.prediction)
    if not diffs:
        return None
    own = spec.own_prediction
    if spec.is_canary and own is not None and own.layers is not None and \
            not replica_vs_prediction(spec.fingerprint, spec.layers, own):
        why = (f"as its replica_overrides entry predicts "
               f"({(spec.override or {}).get('reason', 'canary')}): a canary, odd on purpose")
    else:
        why = "its own config does not explain it either"
    return Problem(
        kind="prediction", replica=spec.replica_id, field=diffs[0].field, layers=diffs,
        message=(f"replica {spec.replica_id} (rank {spec.rank}) differs from the KV spec "
                 f"predicted for the deployment ({spec.prediction.source}) at "
                 f"{len(diffs)} cache(s), {why}: {describe_differences(diffs)}"))


def _judge_alone(spec: ReplicaSpec) -> list[Problem]:
    problems = []
    if spec.ranks_disagreeing:
        problems.append(Problem(
            kind="intra_replica", replica=spec.replica_id, field="layers",
            message=f"replica {spec.replica_id}: worker ranks {spec.ranks_disagreeing} "
                    f"report other specs than rank {spec.workers[0].rank} for the same "
                    "layers (one engine, two KV layouts)"))
    bad = layout_problem(spec.layers, spec.expected_layout)
    if bad:
        problems.append(Problem(kind="expected", replica=spec.replica_id, field="cache_dtype",
                                message=f"replica {spec.replica_id}: {bad} (its "
                                        f"expected_layout is {spec.expected_layout})"))
    if spec.prediction.layers is not None:
        found = _odd_against_prediction(spec)
        if found:
            problems.append(found)
    return problems


def _judge_peers(group: Sequence[ReplicaSpec]) -> tuple[ReplicaSpec, list[Problem]]:
    ref = majority_reference(group)
    problems = []
    for spec in group:
        if spec.fingerprint == ref.fingerprint:
            continue
        diffs = peer_differences(spec.layers, ref.layers)
        problems.append(Problem(
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
    problems: list[Problem] = []
    odd: dict[str, str] = {}
    for spec in specs:
        found = _judge_alone(spec)
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
    for gap in no_answers:
        problems.append(Problem(kind="no_answer", replica=gap.replica, message=gap.message))
    missing = (running or 0) - len(specs) - len(no_answers)
    if missing > 0:
        problems.append(Problem(kind="silent", message=f"{missing} RUNNING replica(s) did "
                                "not answer kv_page_spec"))
    if running == 0 or (running is None and not specs):
        problems.append(Problem(kind="no_replicas", message="no RUNNING replica to compare"))
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
    main_ref = (predicted or [(None, unpredicted[0])])[0][1]
    return Expected(layout=layout, fingerprint=main_ref.fingerprint,
                    reference="prediction" if predicted else "majority", note=note)


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


# ------------------------------------------------------------------ enforcement


ALLOWED = {"warn": (Action.SERVE,), "drain": (Action.SERVE, Action.DRAIN),
           "enforce": (Action.SERVE, Action.DRAIN, Action.FAIL_HEALTH)}


def clamp(action: Action, policy: str) -> Action:
    """The strongest action ``policy`` allows that is no stronger than ``action``."""
    allowed = ALLOWED.get(policy, (Action.SERVE,))
    order = (Action.SERVE, Action.DRAIN, Action.FAIL_HEALTH)
    return max((a for a in allowed if order.index(a) <= order.index(action)),
               key=order.index)


@dataclass
class _Rank:
    fingerprint: str
    attempts: int = 0
    last_at: float = 0.0
    failed: set[str] = field(default_factory=set)


@dataclass
class EnforceBook:
    """Bounded enforcement: replace an odd rank at most ``max_attempts`` times, with backoff.

    Serve replaces a replica that fails health with one of the same rank, config
    and node type; if that one is odd again in the same way (same fingerprint),
    replacing it forever only reboots engines (on a DP preset, the whole gang).
    After ``max_attempts`` replacements -- or while waiting out the backoff
    (``backoff_s * 2**(attempts-1)``) -- the replica is drained instead.
    """

    max_attempts: int
    backoff_s: float
    ranks: dict[Any, _Rank] = field(default_factory=dict)

    def action(self, spec: ReplicaSpec, odd: bool, policy: str,
               now: float) -> tuple[Action, int, str | None]:
        """(action, attempts so far, why it is not the policy's full action)."""
        key = spec.rank if spec.rank is not None else spec.replica_id
        if not odd:
            self.ranks.pop(key, None)
            return Action.SERVE, 0, None
        if policy != "enforce":
            return clamp(Action.DRAIN, policy), 0, None
        book = self.ranks.get(key)
        if book is None or book.fingerprint != spec.fingerprint:
            book = self.ranks[key] = self._recalled(spec, now)
        if spec.replica_id in book.failed:
            return Action.FAIL_HEALTH, book.attempts, None
        if book.attempts >= self.max_attempts:
            return Action.DRAIN, book.attempts, (
                f"enforce gave up: rank {spec.rank} was replaced {book.attempts} time(s) and "
                f"came back odd with the same KV spec (dsv4.enforce_max_attempts="
                f"{self.max_attempts}); drained instead, kept for inspection")
        wait = self.backoff_s * 2 ** (book.attempts - 1) if book.attempts else 0.0
        if now - book.last_at < wait:
            return Action.DRAIN, book.attempts, (
                f"enforce backoff: rank {spec.rank} is odd again after {book.attempts} "
                f"replacement(s); drained for {wait - (now - book.last_at):.0f} s more "
                "before the next one")
        book.attempts += 1
        book.last_at = now
        book.failed.add(spec.replica_id)
        return Action.FAIL_HEALTH, book.attempts, None

    @staticmethod
    def _recalled(spec: ReplicaSpec, now: float) -> _Rank:
        """A rank's book as its live replica remembers it (the verdict it echoes).

        The book lives in the controller; a restarted controller would otherwise
        start every odd rank at 0 attempts and replace a given-up replica again.
        The backoff restarts from now (the last replacement's time is not echoed).
        """
        held = spec.verdict
        if not (held.odd and held.attempts and held.policy == "enforce"):
            return _Rank(spec.fingerprint)
        book = _Rank(spec.fingerprint, attempts=held.attempts, last_at=now)
        if held.action is Action.FAIL_HEALTH:
            book.failed.add(spec.replica_id)  # already being replaced: keep it so
        return book


def verdicts_held(message: VerdictMessage, specs: Sequence[ReplicaSpec]) -> bool:
    """True if every replica in ``message`` already acts on its entry (as echoed in ``specs``).

    The controller then skips sending it: what ``take_verdict`` would make of
    each entry equals the verdict the replica reported in this check.
    """
    by_id = {s.replica_id: s for s in specs}
    for rid, new in message.replicas.items():
        spec = by_id.get(rid)
        if spec is None:
            return False
        policy = message.policy_override or spec.policy
        now = spec.verdict
        if (now.odd, now.reason, now.action, now.policy, now.attempts) != (
                new.odd, new.reason, clamp(new.action, policy), policy, new.attempts):
            return False
    return True


# ------------------------------------------------------------ the replica's side


def take_verdict(message: dict[str, Any], replica_id: str, own_policy: str,
                 previous: ReplicaVerdict) -> ReplicaVerdict:
    """This replica's entry of a ``VerdictMessage``, clamped to the policy it may obey.

    The replica obeys its own configured policy (during a rollout the old
    replicas keep the policy they were deployed with), or an operator's explicit
    ``set_policy`` override carried in the message; never more than that allows.
    """
    msg = VerdictMessage.model_validate(message)
    mine = msg.replicas.get(replica_id)
    if mine is None:  # not judged in this check (did not answer in time): keep the last word
        return previous
    policy = msg.policy_override or own_policy
    action = clamp(mine.action, policy)
    verdict = mine.model_copy(update={"action": action, "policy": policy})
    if verdict.odd and (verdict.reason, verdict.action) != (previous.reason, previous.action):
        logger.warning("dsv4: KV-spec controller marked this replica odd; action %s under "
                       "policy %s (attempt %s): %s", action.value, policy, verdict.attempts,
                       verdict.reason)
    elif previous.odd and not verdict.odd:
        logger.info("dsv4: KV-spec controller no longer names this replica; serving")
    return verdict


def drain_stats(verdict: ReplicaVerdict) -> dict[str, Any]:
    """The routing stats ``deployments.router.KVSpecRouter`` reads to skip this replica."""
    return {DRAIN_STAT: verdict.action is Action.DRAIN,
            "dsv4_kv_reason": verdict.reason if verdict.action is Action.DRAIN else None}


def raise_if_enforced(verdict: ReplicaVerdict) -> None:
    if verdict.action is Action.FAIL_HEALTH:
        raise KVLayoutMismatch(
            f"KV spec disagrees with the fleet under policy enforce (attempt "
            f"{verdict.attempts}): {verdict.reason}. Fix: make every replica's node and "
            "engine_kwargs give the same KV spec, or set dsv4.policy: drain/warn to keep "
            "it up while you investigate."
        )
