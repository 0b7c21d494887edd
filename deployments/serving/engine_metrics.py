"""vLLM's engine histograms, kept in the replica and exported as totals.

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
"""

from __future__ import annotations

import threading
import time
from typing import Any

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


class _Flusher:
    """Every family's totals into its gauges, every ``FLUSH_S``, on one daemon thread."""

    def __init__(self, thread: bool = True) -> None:
        self._lock = threading.Lock()
        self._families: dict[int, _Family] = {}
        self._thread: threading.Thread | None = None
        self._start_thread = thread  # False: flushed only by calls (tests)

    def add(self, family: _Family) -> None:
        with self._lock:
            self._families.setdefault(id(family), family)
            if self._thread is None and self._start_thread:
                self._thread = threading.Thread(target=self._run, name="dsv4-engine-histograms",
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
                logger.exception("dsv4: exporting vLLM's engine histograms failed")


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


def install() -> bool:
    """Before the engine starts: vLLM's Ray stat logger builds its histograms as
    ``BucketHistogram``. False (logged) when the touch is absent in this Ray/vLLM."""
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
