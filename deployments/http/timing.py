"""The serving path's own time per request, by stage, as Prometheus histograms.

Ray's users ask how much of a request's TTFT is the serving layer and how much the
engine (ray#63585, beside ray#59681). Two ASGI layers answer it on every replica,
around the edge (``edge.edge_stack`` puts them there with ``around``):

* ``TimingMiddleware``, outermost: the request's arrival at the replica, the first
  response chunk as it leaves, each later chunk, the final status, and the edge's
  refusal reason if the edge answered itself (``note_refusal``);
* ``PassedEdge``, innermost: when vLLM's app gets the request (keys, route, body and
  bounds are done) and when the app hands each chunk to the edge.

So for a generation request (``POST``) ``dsv4_serve_request_stage_seconds`` splits the
TTFT the replica delivers (``dsv4_serve_time_to_first_token_seconds``) exactly:
``edge`` (arrival to vLLM's app, plus the edge's work on the first chunk) +
``engine_first_token`` (vLLM's app and engine to their first chunk); ``edge_stream``
is the edge's work on the later chunks (its share of the time per output token).
Engine-internal queueing is vLLM's ``vllm:request_queue_time_seconds``. The series
carry Serve's ``replica`` tag; ``dsv4_kv_replica_info`` gives the node type to join on.
Ray's export estimates a histogram's ``_sum`` from bucket midpoints, so the exact
seconds also go to counters (``..._seconds_total``): means and shares use those.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.observe import series

# The scope key of a request's clock (an object: middlewares that copy the scope share it).
CLOCK_KEY = "dsv4.timing"
# Only these requests are timed by stage: generation. GETs (models, kv-spec) are not.
TIMED_METHODS = frozenset({"POST"})


@dataclass
class RequestClock:
    """One request's timestamps on the replica (``time.perf_counter`` seconds)."""

    arrived: float
    passed_edge: float | None = None
    first_chunk: float | None = None  # the app's first chunk, handed to the edge
    first_out: float | None = None  # the same chunk leaving the replica
    edge_first: float = 0.0  # the edge's work on the first chunk
    edge_stream: float = 0.0  # the edge's work on the later chunks, summed
    handed: float | None = None  # when the app handed the chunk now crossing the edge
    status: int | None = None
    refused: str | None = None


def note_refusal(scope: Scope, reason: str) -> None:
    """Record that the edge answered this request itself, and why (counted by reason)."""
    clock = scope.get(CLOCK_KEY)
    if isinstance(clock, RequestClock):
        clock.refused = reason


# Under Ray's default export interval (10 s), whose two intervals are the gauge TTL.
REPORT_EVERY_S = 5.0


class StageSeries:
    """The Ray metrics of the serving path (``observe.series``), one set per process."""

    def __init__(self) -> None:
        (self.stage, self.ttft, self.stage_total, self.ttft_total, self.in_flight,
         self.refused) = series.make_each(series.STAGE, series.TTFT, series.STAGE_TOTAL,
                                          series.TTFT_TOTAL, series.IN_FLIGHT, series.REFUSED)
        self._in_flight = 0
        self._reporter: asyncio.Task[None] | None = None

    def started(self) -> None:
        self._in_flight += 1
        self.in_flight.set(self._in_flight)
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.get_running_loop().create_task(self._keep_reported())

    async def _keep_reported(self) -> None:
        """Re-set the in-flight gauge while the replica lives: Ray's metrics agent evicts
        a gauge not re-reported within two export intervals (``_gauge_metric_ttl_s`` in
        ray/_private/telemetry/open_telemetry_metric_recorder.py), and an idle replica
        would otherwise drop out of the in-flight panel."""
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            self.in_flight.set(self._in_flight)

    def finished(self, clock: RequestClock, method: str) -> None:
        self._in_flight -= 1
        self.in_flight.set(self._in_flight)
        for name, seconds in stages(clock, method).items():
            self.stage.observe(seconds, tags={"stage": name})
            if seconds > 0:  # a Ray counter takes positive steps only
                self.stage_total.inc(seconds, tags={"stage": name})
        if method in TIMED_METHODS and clock.first_out is not None:
            self.ttft.observe(clock.first_out - clock.arrived)
            self.ttft_total.inc(max(clock.first_out - clock.arrived, 1e-9))
        reason = refusal_reason(clock)
        if reason is not None:
            self.refused.inc(tags={"reason": reason})


def stages(clock: RequestClock, method: str) -> dict[str, float]:
    """Seconds per stage of one finished request (empty for untimed or refused ones)."""
    if method not in TIMED_METHODS or clock.passed_edge is None:
        return {}
    out = {"edge": clock.passed_edge - clock.arrived + clock.edge_first}
    if clock.first_chunk is not None:
        out["engine_first_token"] = clock.first_chunk - clock.passed_edge
        out["edge_stream"] = clock.edge_stream
    return out


def refusal_reason(clock: RequestClock) -> str | None:
    """Why the edge answered a request itself, or None when the app answered it.

    The edge names its reason (``note_refusal`` from its one refusal function); an
    error it sent without one (a WebSocket refused, an exception turned into a 500)
    counts as ``status_<code>``.
    """
    if clock.refused is not None:
        return clock.refused
    if clock.passed_edge is None and clock.status is not None and clock.status >= 400:
        return f"status_{clock.status}"
    return None


class TimingMiddleware:
    """Outermost layer: starts the request's clock, times the chunks as they leave."""

    def __init__(self, app: ASGIApp, stage_series: StageSeries | None = None):
        self.app = app
        self.series = stage_series or StageSeries()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        clock = RequestClock(time.perf_counter())
        scope[CLOCK_KEY] = clock

        async def timed(message: Message) -> None:
            if message["type"] == "http.response.start":
                clock.status = message["status"]
            elif message["type"] == "http.response.body" and clock.handed is not None:
                now = time.perf_counter()
                if clock.first_out is None:
                    clock.first_out, clock.edge_first = now, now - clock.handed
                else:
                    clock.edge_stream += now - clock.handed
                clock.handed = None
            await send(message)

        self.series.started()
        try:
            await self.app(scope, receive, timed)
        finally:
            self.series.finished(clock, scope.get("method", ""))


class PassedEdge:
    """Innermost layer of the edge: the request reached vLLM's app; its chunks enter the edge."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        clock = scope.get(CLOCK_KEY)
        if scope["type"] != "http" or not isinstance(clock, RequestClock):
            await self.app(scope, receive, send)
            return
        clock.passed_edge = time.perf_counter()

        async def handed(message: Message) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                now = time.perf_counter()
                if clock.first_chunk is None:
                    clock.first_chunk = now
                clock.handed = now
            await send(message)

        await self.app(scope, receive, handed)


Layer = tuple[Callable[..., Any], dict[str, Any]]


def around(layers: list[Layer]) -> list[Layer]:
    """The edge's layers with the timing layers outside and inside them."""
    return [(TimingMiddleware, {}), *layers, (PassedEdge, {})]
