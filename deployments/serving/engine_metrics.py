"""vLLM's engine histograms and gauges, kept in the replica and exported by one thread.

Ray Serve LLM logs engine metrics (``log_engine_metrics``, on by default) through vLLM's
``RayPrometheusStatLogger``, whose histograms are ``ray.util.metrics.Histogram``. Ray
2.60's metrics agent (its default OpenTelemetry backend) re-records every exported
histogram observation, one Python ``record`` call each
(``OpenTelemetryMetricRecorder.record_histogram_aggregated_batch``; passing bucket
counts through is ray#64852), and vLLM observes inter-token latency once per streamed
token: ~12 us of the node agent's CPU per token, a fifth of vLLM's whole API server per
token at one GPU's rate (``benchmarks/metrics_backend.py``, docs/benchmarks.md §2k).
Ray's sums are bucket midpoints too (a 4 ms ITL counts as 5 ms).

``BucketHistogram`` takes the place of vLLM's ``RayHistogramWrapper`` in the replica
(``install``; the ``llm.engine_histograms`` touch): each labeled histogram counts its
observations in this process (``observe.buckets``) and a daemon thread sets the totals
every ``FLUSH_S`` into three Ray gauges with the series names and labels Ray exported
before, ``<name>_bucket{le}``, ``<name>_sum``, ``<name>_count``: the same samples for
dashboards and ``histogram_quantile``, exact sums, gauge-typed. The agent then handles
a few numbers per histogram per export, whatever the token rate.

``KeptGauge`` takes the place of vLLM's ``RayGaugeWrapper`` (the ``llm.engine_gauges``
touch): vLLM sets ``kv_cache_usage_perc``, ``num_requests_running/waiting`` and the rest
only when its engine steps, and Ray's agent drops a gauge not set for two export
intervals, so an idle fleet's KV and queue panels went empty ~20 s after the last
request. Each set goes to Ray at once and is remembered; the same flush thread sets every
remembered value again each keep-alive, so an idle replica keeps exporting its last
state (0 running, 0 waiting: vLLM's last step reports the counts after it freed the
finished requests).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from ray.util import metrics as ray_metrics

from deployments import ray_touches
from deployments.logs import get_logger
from deployments.observe.buckets import BucketCounts

logger = get_logger(__name__)

FLUSH_S = 1.0  # well inside Ray's ~10 s export interval: an export sees <= 1 s of lag
# Unchanged series are set again every KEEP_EVERY flushes: Ray's agent drops a gauge not
# reported for two export intervals (~20 s), and an idle replica sets nothing in between.
KEEP_EVERY = 5
TOUCH = "llm.engine_histograms"
GAUGE_TOUCH = "llm.engine_gauges"


class _Kept(Protocol):
    """What the flush thread sets: everything changed, or everything (keep-alive)."""

    def set(self, unchanged_too: bool) -> None: ...


class _Family:
    """One histogram name: its labeled counts, and the three gauges they are set into."""

    def __init__(self, name: str, documentation: str, tag_keys: tuple[str, ...],
                 bounds: list[float]) -> None:
        self.bucket = ray_metrics.Gauge(f"{name}_bucket", description=documentation,
                                        tag_keys=(*tag_keys, "le"))
        self.sum = ray_metrics.Gauge(f"{name}_sum", description=documentation,
                                     tag_keys=tag_keys)
        self.count = ray_metrics.Gauge(f"{name}_count", description=documentation,
                                       tag_keys=tag_keys)
        self._bounds = bounds
        self._lock = threading.Lock()
        self._counts: dict[tuple[tuple[str, str], ...], BucketCounts] = {}
        self._set_count: dict[tuple[tuple[str, str], ...], int] = {}  # flusher thread only

    def counts_for(self, tags: dict[str, str]) -> BucketCounts:
        """The counts of one label set (one per set, however often vLLM labels it)."""
        key = tuple(sorted(tags.items()))
        with self._lock:
            counts = self._counts.get(key)
            if counts is None:
                counts = self._counts[key] = BucketCounts(self._bounds)
        FLUSHER.add(self)
        return counts

    def set(self, unchanged_too: bool) -> None:
        """Each label set's totals into the gauges: those observed since the last call,
        or all (``unchanged_too``: Ray's agent drops a gauge not set for a while)."""
        with self._lock:
            series = list(self._counts.items())
        for key, counts in series:
            tags = dict(key)
            cumulative, total, count = counts.snapshot()
            if not unchanged_too and self._set_count.get(key) == count:
                continue
            self._set_count[key] = count
            for le, value in cumulative:
                self.bucket.set(value, tags=tags | {"le": le})
            self.sum.set(total, tags=tags)
            self.count.set(count, tags=tags)


GAUGES: dict[str, _GaugeFamily] = {}  # by exported name (vllm_kv_cache_usage_perc, ...)


def engine_load() -> tuple[float, float, float] | None:
    """(KV usage 0..1, mean over engines; waiting; running) as vLLM last set them in this
    replica, or None before the engine's first step (what autoscaling reads)."""
    kv = GAUGES.get("vllm_kv_cache_usage_perc")
    if kv is None or not kv.values():
        return None
    usage = kv.values()
    waiting, running = (sum(f.values()) if (f := GAUGES.get(name)) else 0.0
                        for name in ("vllm_num_requests_waiting", "vllm_num_requests_running"))
    return sum(usage) / len(usage), waiting, running


class _GaugeFamily:
    """One vLLM gauge: the Ray gauge, and the last value of each label set, set again
    at each keep-alive (vLLM sets its engine gauges only while the engine steps)."""

    def __init__(self, name: str, documentation: str, tag_keys: tuple[str, ...]) -> None:
        self.gauge = ray_metrics.Gauge(name, description=documentation, tag_keys=tag_keys)
        self._lock = threading.Lock()
        self._last: dict[tuple[tuple[str, str], ...], float] = {}
        GAUGES[name] = self

    def values(self) -> list[float]:
        """The last value of each label set (one per engine of the replica)."""
        with self._lock:
            return list(self._last.values())

    def record(self, value: float, tags: dict[str, str]) -> None:
        """Set now (a change is exported at the next export) and remember it."""
        key = tuple(sorted(tags.items()))
        with self._lock:
            first = not self._last
            self._last[key] = value
        self.gauge.set(value, tags=tags)
        if first:
            FLUSHER.add(self)

    def set(self, unchanged_too: bool) -> None:
        """At a keep-alive, every label set's last value again (changes went at once)."""
        if not unchanged_too:
            return
        with self._lock:
            last = list(self._last.items())
        for key, value in last:
            self.gauge.set(value, tags=dict(key))


class _Flusher:
    """Every family's state into its gauges, every ``FLUSH_S``, on one daemon thread:
    histogram totals when they change, and everything at each keep-alive."""

    def __init__(self, thread: bool = True) -> None:
        self._lock = threading.Lock()
        self._families: dict[int, _Kept] = {}
        self._thread: threading.Thread | None = None
        self._start_thread = thread  # False: flushed only by calls (tests)

    def add(self, family: _Kept) -> None:
        with self._lock:
            self._families.setdefault(id(family), family)
            if self._thread is None and self._start_thread:
                self._thread = threading.Thread(target=self._run, name="dsv4-engine-metrics",
                                                daemon=True)
                self._thread.start()

    def flush(self, unchanged_too: bool = True) -> None:
        """Set the families' gauges now (what the thread does each period)."""
        with self._lock:
            families = list(self._families.values())
        for family in families:
            family.set(unchanged_too)

    def _run(self) -> None:
        rounds = 0
        while True:
            time.sleep(FLUSH_S)
            rounds += 1
            try:
                self.flush(unchanged_too=rounds % KEEP_EVERY == 0)
            except Exception:  # a metrics bug must not stop the next flush; logged each time
                logger.exception("dsv4: exporting vLLM's engine metrics failed")


FLUSHER = _Flusher()


def histogram_class() -> type:
    """``BucketHistogram``, built on the installed vLLM's ``RayPrometheusMetric`` (its
    label handling, ``ReplicaId`` included, stays vLLM's)."""
    from vllm.v1.metrics.ray_wrappers import RayPrometheusMetric

    class BucketHistogram(RayPrometheusMetric):
        """``RayHistogramWrapper``'s API (``labels``, ``observe``), counted here."""

        def __init__(self, name: str, documentation: str | None = "",
                     labelnames: list[str] | None = None,
                     buckets: list[float] | None = None) -> None:
            super().__init__()
            tag_keys = self._get_tag_keys(labelnames)
            name = self._get_sanitized_opentelemetry_name(name)
            self._family = _Family(name, documentation or "", tag_keys, list(buckets or []))
            self.metric = self._family.sum  # what vLLM's _build_tags reads the tag keys of
            self._counts: BucketCounts | None = None

        def labels(self, *labels: Any, **labelskwargs: Any) -> BucketHistogram:
            clone: BucketHistogram = super().labels(*labels, **labelskwargs)
            clone._counts = None  # its label set's counts, not the unlabeled parent's
            return clone

        def observe(self, value: float) -> None:
            counts = self._counts
            if counts is None:
                counts = self._counts = self._family.counts_for(self._tags)
            counts.observe(value)

    return BucketHistogram


def gauge_class() -> type:
    """``KeptGauge``, on the installed vLLM's ``RayPrometheusMetric`` like the histograms."""
    from vllm.v1.metrics.ray_wrappers import RayPrometheusMetric

    class KeptGauge(RayPrometheusMetric):
        """``RayGaugeWrapper``'s API (``labels``, ``set``, ``set_to_current_time``)."""

        def __init__(self, name: str, documentation: str | None = "",
                     labelnames: list[str] | None = None,
                     multiprocess_mode: str | None = "") -> None:
            del multiprocess_mode  # Ray's series are per worker already (as vLLM's wrapper)
            super().__init__()
            tag_keys = self._get_tag_keys(labelnames)
            name = self._get_sanitized_opentelemetry_name(name)
            self._family = _GaugeFamily(name, documentation or "", tag_keys)
            self.metric = self._family.gauge  # what vLLM's _build_tags reads the tag keys of

        def set(self, value: float) -> None:
            self._family.record(float(value), self._tags)

        def set_to_current_time(self) -> None:
            self.set(time.time())

    return KeptGauge


def _install_gauges() -> None:
    """vLLM's Ray stat loggers build their gauges as ``KeptGauge`` (idempotent)."""
    from vllm.v1.metrics import ray_wrappers

    if not ray_touches.present(GAUGE_TOUCH):
        logger.warning("dsv4: vLLM's Ray gauges are not where dsv4-serve expects them (ray "
                       "touch %s): engine gauges vanish from the scrape ~20 s into idle",
                       GAUGE_TOUCH)
        return
    if getattr(ray_wrappers.RayPrometheusStatLogger._gauge_cls, "dsv4_kept", False):
        return
    cls = gauge_class()
    cls.dsv4_kept = True  # type: ignore[attr-defined]  # marks ours (idempotent install)
    ray_wrappers.RayPrometheusStatLogger._gauge_cls = cls
    ray_wrappers.RayKVConnectorProm._gauge_cls = cls
    logger.info("dsv4: vLLM's engine gauges are set again every %g s while idle (Ray's "
                "agent drops a gauge not set for two export intervals)", FLUSH_S * KEEP_EVERY)


def install() -> bool:
    """Before the engine starts: vLLM's Ray stat logger builds its histograms as
    ``BucketHistogram`` and its gauges as ``KeptGauge``. False (logged) when the
    histogram touch is absent in this Ray/vLLM."""
    _install_gauges()
    if not ray_touches.present(TOUCH):
        logger.warning("dsv4: vLLM's Ray stat logger is not where dsv4-serve expects it "
                       "(ray touch %s): engine histograms stay Ray histograms, and Ray's "
                       "metrics agent pays per observation", TOUCH)
        return False
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    if not getattr(RayPrometheusStatLogger._histogram_cls, "dsv4_bucketed", False):
        cls = histogram_class()
        cls.dsv4_bucketed = True  # type: ignore[attr-defined]  # marks ours (idempotent install)
        RayPrometheusStatLogger._histogram_cls = cls
        logger.info("dsv4: vLLM's engine histograms are counted in this replica and set "
                    "every %g s as gauges <name>_bucket{le} / _sum / _count (Ray's agent "
                    "would replay each observation)", FLUSH_S)
    return True
