"""A histogram's state as Prometheus exposes it: cumulative bucket counts, sum and count.

``deployments.serving.engine_metrics`` keeps vLLM's histograms in the replica with this
and exports the totals, so Ray's metrics agent handles a few numbers per export instead
of one Python call per observation. Bucket rules are Prometheus's (what
``prometheus_client.Histogram`` does, compared by tests): upper bounds inclusive, an
implicit ``+Inf`` bucket; ``le`` labels as Ray's exporter writes them.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence

INF_LABEL = "+Inf"


def le_label(bound: float) -> str:
    """The ``le`` label text of an upper bound as Ray 2.60's exporter writes it today
    (OpenTelemetry's Prometheus exporter: ``f"{bound}"`` of the float, then ``+Inf``),
    so a dashboard's ``le`` matchers keep matching."""
    return INF_LABEL if math.isinf(bound) and bound > 0 else f"{float(bound)}"


class BucketCounts:
    """One labeled histogram: ``observe`` from any thread, ``snapshot`` consistent."""

    def __init__(self, bounds: Sequence[float]) -> None:
        finite = sorted(float(b) for b in bounds if not math.isinf(float(b)))
        if len(set(finite)) != len(finite):
            raise ValueError(f"histogram buckets {list(bounds)}: expected distinct bounds. "
                             "Fix: remove the repeated bound.")
        self.bounds = (*finite, math.inf)
        self._counts = [0] * len(self.bounds)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        """Count ``value`` in the first bucket whose upper bound is >= it."""
        index = bisect.bisect_left(self.bounds, value)  # the last bound is +Inf
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[tuple[str, int]], float, int]:
        """(``le`` label -> cumulative count, in bound order), sum, count."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip(self.bounds, counts, strict=True):
            running += count
            cumulative.append((le_label(bound), running))
        return cumulative, total, running
