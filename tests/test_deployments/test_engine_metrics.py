"""vLLM's engine histograms counted in the replica (``deployments.serving.engine_metrics``).

The counts must be what a Prometheus histogram would expose (checked against
``prometheus_client.Histogram``), the ``le`` labels what Ray's exporter writes today
(OpenTelemetry's Prometheus exporter, the code Ray 2.60's agent runs), and the class
must keep the API of the vLLM wrapper it stands in for. The session stack's scrape
(``test_serve_metrics``) checks the exported series end to end.
"""

from __future__ import annotations

import inspect
import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from deployments.observe.buckets import BucketCounts, le_label

VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0]
TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


@pytest.mark.parametrize("bounds", [VLLM_ITL, TOKENS, [0.5]])
def test_counts_are_prometheus_clients(bounds: list[float]) -> None:
    rng = random.Random(7)
    values = [rng.uniform(0, 2 * max(bounds)) for _ in range(2000)]
    values += [float(b) for b in bounds] + [0.0, max(bounds) * 10]  # bounds are inclusive
    registry = CollectorRegistry()
    ref = Histogram("h", "h", buckets=bounds, registry=registry)
    ours = BucketCounts(bounds)
    for v in values:
        ref.observe(v)
        ours.observe(v)
    want = {s.labels["le"]: s.value for s in next(iter(registry.collect())).samples
            if s.name == "h_bucket"}
    cumulative, total, count = ours.snapshot()
    got = dict(cumulative)
    assert [float(le) for le in got] == [float(le) for le in want]
    assert list(got.values()) == list(want.values())
    assert count == len(values) and total == pytest.approx(sum(values))


def test_le_labels_are_what_rays_exporter_writes() -> None:
    """Ray 2.60's agent exports through opentelemetry-exporter-prometheus: its own
    bucket conversion gives the label texts dashboards match on today."""
    from opentelemetry.exporter.prometheus import _convert_buckets

    for bounds in (VLLM_ITL, TOKENS):
        theirs = [le for le, _ in _convert_buckets([0] * (len(bounds) + 1),
                                                    [float(b) for b in bounds])]
        ours = [le for le, _ in BucketCounts(bounds).snapshot()[0]]
        assert ours == theirs
    assert le_label(math.inf) == "+Inf"


def test_repeated_bounds_are_named() -> None:
    with pytest.raises(ValueError, match=r"expected distinct bounds"):
        BucketCounts([0.1, 0.1, 1.0])


def test_bucket_histogram_keeps_the_vllm_wrappers_api() -> None:
    """Same constructor and methods as ``RayHistogramWrapper`` (installed vLLM)."""
    from vllm.v1.metrics.ray_wrappers import RayHistogramWrapper

    from deployments.serving.engine_metrics import histogram_class

    ours = histogram_class()
    for method in ("__init__", "observe"):
        assert inspect.signature(getattr(ours, method)).parameters.keys() == \
            inspect.signature(getattr(RayHistogramWrapper, method)).parameters.keys(), method
    assert issubclass(ours, RayHistogramWrapper.__mro__[1])  # vLLM's RayPrometheusMetric


def test_one_label_set_counts_once_however_often_it_is_labeled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from deployments.serving import engine_metrics

    flusher = engine_metrics._Flusher(thread=False)  # no thread left behind in pytest
    monkeypatch.setattr(engine_metrics, "FLUSHER", flusher)
    hist = engine_metrics.histogram_class()("vllm:test_seconds", "test",
                                            ["model_name", "engine"], [0.1, 1.0])
    first, again = hist.labels(model_name="m", engine="0"), hist.labels("m", "0")
    other = hist.labels(model_name="m", engine="1")
    for child, value in ((first, 0.05), (again, 0.5), (other, 5.0)):
        child.observe(value)
    assert first._counts is again._counts is not other._counts
    assert first._counts.snapshot() == ([("0.1", 1), ("1.0", 2), ("+Inf", 2)], 0.55, 2)
    assert len(flusher._families) == 1
    flusher.flush()  # sets Ray gauges; no Ray cluster needed to call it


def test_install_swaps_the_stat_loggers_histograms_once() -> None:
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    from deployments.serving import engine_metrics

    before = RayPrometheusStatLogger._histogram_cls
    try:
        assert engine_metrics.install()
        installed = RayPrometheusStatLogger._histogram_cls
        assert getattr(installed, "dsv4_bucketed", False)
        assert engine_metrics.install() and RayPrometheusStatLogger._histogram_cls is installed
    finally:
        RayPrometheusStatLogger._histogram_cls = before


def test_a_flush_sets_what_changed_and_a_keepalive_sets_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Between keep-alives only label sets observed since the last flush are set again
    (an idle replica costs nothing); a keep-alive sets every one (Ray's agent drops a
    gauge it has not heard of for two export intervals)."""
    from deployments.serving import engine_metrics

    monkeypatch.setattr(engine_metrics, "FLUSHER", engine_metrics._Flusher(thread=False))
    hist = engine_metrics.histogram_class()("vllm:flush_test_seconds", "test", ["engine"],
                                            [1.0])
    busy, idle = hist.labels(engine="0"), hist.labels(engine="1")
    busy.observe(0.5)
    idle.observe(0.5)
    family = busy._family
    calls: list[dict[str, str]] = []
    monkeypatch.setattr(family.count, "set", lambda value, tags: calls.append(tags))
    family.set(unchanged_too=False)
    assert sorted(c["engine"] for c in calls) == ["0", "1"]
    calls.clear()
    busy.observe(2.0)
    family.set(unchanged_too=False)
    assert [c["engine"] for c in calls] == ["0"]
    calls.clear()
    family.set(unchanged_too=True)
    assert sorted(c["engine"] for c in calls) == ["0", "1"]


def test_kept_gauge_keeps_the_vllm_wrappers_api() -> None:
    """Same constructor and methods as ``RayGaugeWrapper`` (installed vLLM)."""
    from vllm.v1.metrics.ray_wrappers import RayGaugeWrapper

    from deployments.serving.engine_metrics import gauge_class

    ours = gauge_class()
    for method in ("__init__", "set", "set_to_current_time"):
        assert inspect.signature(getattr(ours, method)).parameters.keys() == \
            inspect.signature(getattr(RayGaugeWrapper, method)).parameters.keys(), method
    assert issubclass(ours, RayGaugeWrapper.__mro__[1])


def test_a_gauge_is_set_at_once_and_again_at_each_keepalive_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM sets its gauges only while the engine steps: each set reaches Ray at once, and
    every label set's last value is set again at a keep-alive (Ray's agent drops a gauge
    not set for two export intervals), not at the flushes in between."""
    from deployments.serving import engine_metrics

    flusher = engine_metrics._Flusher(thread=False)
    monkeypatch.setattr(engine_metrics, "FLUSHER", flusher)
    gauge = engine_metrics.gauge_class()("vllm:num_requests_running", "test",
                                         ["model_name", "engine"])
    calls: list[tuple[float, dict[str, str]]] = []
    monkeypatch.setattr(gauge._family.gauge, "set",
                        lambda value, tags: calls.append((value, tags)))
    busy, other = gauge.labels("m", "0"), gauge.labels(model_name="m", engine="1")
    busy.set(3)
    busy.set(0)
    other.set(1)
    assert [(v, t["engine"]) for v, t in calls] == [(3.0, "0"), (0.0, "0"), (1.0, "1")]
    assert len(flusher._families) == 1
    calls.clear()
    flusher.flush(unchanged_too=False)
    assert calls == []
    flusher.flush(unchanged_too=True)
    assert sorted((t["engine"], v) for v, t in calls) == [("0", 0.0), ("1", 1.0)]
    assert all(set(t) == {"model_name", "engine", "ReplicaId"} for _, t in calls)


def test_the_flush_thread_keeps_histograms_and_gauges_alive_together(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread, one keep-alive period for both kinds (no second mechanism)."""
    from deployments.serving import engine_metrics

    flusher = engine_metrics._Flusher(thread=False)
    monkeypatch.setattr(engine_metrics, "FLUSHER", flusher)
    engine_metrics.gauge_class()("vllm:kv_cache_usage_perc", "t", ["engine"]) \
        .labels(engine="0").set(0.5)
    engine_metrics.histogram_class()("vllm:keep_seconds", "t", ["engine"], [1.0]) \
        .labels(engine="0").observe(0.1)
    kinds = {type(f).__name__ for f in flusher._families.values()}
    assert kinds == {"_GaugeFamily", "_Family"}
    assert engine_metrics.KEEP_EVERY * engine_metrics.FLUSH_S < 10.0  # Ray's export interval


def test_install_swaps_the_stat_loggers_gauges_once() -> None:
    from vllm.v1.metrics import ray_wrappers

    from deployments.serving import engine_metrics

    before = (ray_wrappers.RayPrometheusStatLogger._gauge_cls,
              ray_wrappers.RayKVConnectorProm._gauge_cls,
              ray_wrappers.RayPrometheusStatLogger._histogram_cls)
    try:
        assert engine_metrics.install()
        installed = ray_wrappers.RayPrometheusStatLogger._gauge_cls
        assert getattr(installed, "dsv4_kept", False)
        assert ray_wrappers.RayKVConnectorProm._gauge_cls is installed
        assert engine_metrics.install()
        assert ray_wrappers.RayPrometheusStatLogger._gauge_cls is installed
    finally:
        (ray_wrappers.RayPrometheusStatLogger._gauge_cls,
         ray_wrappers.RayKVConnectorProm._gauge_cls,
         ray_wrappers.RayPrometheusStatLogger._histogram_cls) = before
