"""The controller's Prometheus series: the fleet verdict, and what each replica stores and holds.

Every series is declared once in ``deployments.observe.series`` and exported through
Ray's metrics agent (``ray.util.metrics``; scrape each node's agent, ``dsv4-serve run``
prints where). The fleet series carry Serve's tags of the controller plus
``llm_deployment``; the per-replica ones name the *served* replica in ``replica`` (Serve's
``ReplicaID.unique_id``, as vLLM's ``ReplicaId``) and its ``node_type``, and carry the
KV capacity ``dsv4-serve plan`` computes for that node type (``plan.kv_figures``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from deployments.config.dsv4 import node_type_key
from deployments.control.prediction import replica_vs_prediction
from deployments.control.wire import Action, FleetReport, KVCapacityPlan, ReplicaSpec, State
from deployments.observe import series as S

# One series' sample: (name, sorted tags).
Key = tuple[str, tuple[tuple[str, str], ...]]
_PER_REPLICA = (S.REPLICA_INFO, S.AS_PREDICTED, S.PAGE_BYTES, S.BYTES_PER_TOKEN,
                S.CAPACITY_TOKENS, S.ENGINE_CAPACITY_TOKENS, S.BUDGET_BYTES)


class FleetMetrics:
    """The verdict as gauges, tagged by deployment so several apps can share a cluster."""

    def __init__(self, deployment: str):
        self._tags = {"llm_deployment": deployment}
        self.agree, self.running, self.answered, self.odd, self.drained, self.stale, \
            self.age = (S.make(s) for s in (S.AGREE, S.RUNNING, S.ANSWERED, S.ODD,
                                            S.DRAINED, S.STALE, S.AGE))
        self.checks = S.make(S.CHECKS)
        self.replacements = S.make(S.REPLACEMENTS)
        for gauge in (self.agree, self.running, self.answered, self.odd, self.drained,
                      self.stale, self.age):
            gauge.set_default_tags(dict(self._tags))  # Serve adds its tags in place

    def record(self, report: FleetReport) -> None:
        self.agree.set(1 if report.agree else 0)
        self.stale.set(1 if report.state is State.STALE else 0)
        self.age.set(report.age_s or 0.0)
        if report.state is State.STALE:
            return  # the counts below are the last check's; leave them, flagged stale
        self.running.set(report.running_replicas or 0)
        self.answered.set(report.answered)
        self.odd.set(len(report.odd_replicas))
        self.drained.set(sum(r.action is Action.DRAIN and r.reason is not None
                             for r in report.replicas))

    def checked(self, report: FleetReport, replaced: int) -> None:
        self.checks.inc(tags={**self._tags, "state": report.state.value})
        if replaced:
            self.replacements.inc(replaced, tags=dict(self._tags))


def cache_group(role: str, compress_ratio: int | None) -> str:
    """A cache group's label: the cache's role and compress ratio (``main/c4``, ``swa/c1``)."""
    return f"{role}/c{compress_ratio or 1}"


def page_bytes(layers: Sequence[Any] | None) -> dict[str, int]:
    """Page bytes per cache group (the largest, should a group hold several)."""
    groups: dict[str, int] = {}
    for e in layers or ():
        if e.page_size_bytes:
            key = cache_group(e.role, e.compress_ratio)
            groups[key] = max(groups.get(key, 0), e.page_size_bytes)
    return groups


def replica_values(spec: ReplicaSpec, status: str, action: str,
                   capacity: KVCapacityPlan) -> list[tuple[S.Series, dict[str, str], float]]:
    """(series, tags, value) of one answered replica."""
    node_type = node_type_key(spec.node)
    tags = {"application": "", "llm_deployment": "", "replica": spec.replica_id,
            "node_type": node_type}
    prediction = spec.own_prediction or spec.prediction
    info = {"status": status, "action": action, "cache_dtype": ",".join(spec.cache_dtypes),
            "fingerprint": spec.fingerprint[:19],
            "predicted_fingerprint": (prediction.fingerprint or "none")[:19]}
    out: list[tuple[S.Series, dict[str, str], float]] = [(S.REPLICA_INFO, tags | info, 1.0)]
    if prediction.layers is not None:
        same = not replica_vs_prediction(spec.fingerprint, spec.layers, prediction)
        out.append((S.AS_PREDICTED, tags, 1.0 if same else 0.0))
    for source, layers in (("reported", spec.layers), ("predicted", prediction.layers)):
        out += [(S.PAGE_BYTES, tags | {"cache_group": g, "source": source}, float(b))
                for g, b in page_bytes(layers).items()]
    row = capacity.for_node(node_type)
    if row is not None:
        out.append((S.BYTES_PER_TOKEN, tags, row.kv_bytes_per_token))
        for series, value in ((S.CAPACITY_TOKENS, row.kv_tokens_per_replica),
                              (S.ENGINE_CAPACITY_TOKENS, row.kv_tokens_per_engine),
                              (S.BUDGET_BYTES, row.kv_budget_bytes)):
            if value is not None:
                out.append((series, tags, float(value)))
    return out


class ReplicaMetrics:
    """Per-replica KV series, re-set every round (Ray evicts a gauge not re-reported).

    A replica that stops answering keeps its last values until it is gone from Serve;
    a gone replica's series are set to 0 once and then no longer reported (Ray evicts
    them), so sums over replicas and the ``dsv4_kv_replica_info == 1`` filter count only
    live ones.
    """

    def __init__(self, deployment: str, capacity: KVCapacityPlan, application: str = ""):
        self._deployment = deployment
        self._application = application
        self.capacity = capacity
        self._metrics = {s.name: S.make(s, serve_tags=False) for s in _PER_REPLICA}
        self._last: dict[Key, float] = {}
        # A replica's values change only with its spec or verdict: computed once each.
        self._cache: dict[tuple[str, str, str, str], dict[Key, float]] = {}

    def _values(self, spec: ReplicaSpec, status: str, action: str) -> dict[Key, float]:
        key = (spec.replica_id, spec.fingerprint, status, action)
        if key not in self._cache:
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = {
                (series.name, tuple(sorted((tags | {"llm_deployment": self._deployment,
                                                   "application": self._application})
                                           .items()))): value
                for series, tags, value in replica_values(spec, status, action, self.capacity)}
        return self._cache[key]

    def record(self, report: FleetReport, specs: Sequence[ReplicaSpec],
               silent: Collection[str] = ()) -> None:
        """Set every answered replica's series; ``silent`` replicas keep their last values.

        A series no longer produced (the replica is gone, or its labels changed) is
        set to 0 once and forgotten.
        """
        rows = {r.id: r for r in report.replicas}
        answered = {s.replica_id for s in specs}
        now: dict[Key, float] = {}
        for spec in specs:
            row = rows.get(spec.replica_id)
            status = row.status.value if row else "ok"
            action = row.action.value if row else "serve"
            now.update(self._values(spec, status, action))
        for key, value in self._last.items():
            if key in now:
                continue
            replica = dict(key[1])["replica"]
            if replica in silent and replica not in answered:
                now[key] = value
            elif value != 0.0:
                self._metrics[key[0]].set(0.0, tags=dict(key[1]))
        for key, value in now.items():
            # Every round, changed or not: Ray's metrics agent drops a gauge that was
            # not re-reported within two export intervals (``_gauge_metric_ttl_s`` in
            # ray/_private/telemetry/open_telemetry_metric_recorder.py).
            self._metrics[key[0]].set(value, tags=dict(key[1]))
        self._last = now
