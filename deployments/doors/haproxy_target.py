"""Behind HAProxy the replica answers on a port of its own, on its user-code event loop.

Why (issue 34, docs/benchmarks.md §2h): Ray 2.60's direct-ingress server runs on
Serve's event loop while the app runs on the user-code thread, so every streamed chunk
crosses threads (``call_soon_threadsafe`` per ASGI message) and a second loop: ~0.1
CPU-ms per token, the whole serving path's excess over vLLM's own API server. The
replica's own listener (``deployments.doors.listener``, already the local default's
door) serves the app where it runs.

How: once Serve's direct-ingress server has its port (``Replica._http_port``, set as
the replica finishes starting), the replica binds ``serve_env.replica_port_for`` of it
on the same host (``Replica._http_options.host``), and serves ``BehindHAProxy(app)``
there (under the app's route prefix, ``Replica._route_prefix``, as Serve mounts it);
``dsv4-haproxy`` points HAProxy's server line at that port. What Serve's own
server gave HAProxy and Serve is kept:

* ``/-/healthz`` is Serve's data-plane answer (``Replica._dataplane_health_check``,
  with our drain gate, ``deployments.doors.dataplane``), run on Serve's loop;
* each request is counted in Serve's ongoing requests (``ReplicaMetricsManager``, on
  Serve's loop: two hops per request, none per token), which Serve's autoscaler and
  its graceful drain read;
* a stopping replica keeps answering through Ray's draining window
  (``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S``, while its health check fails),
  then closes the port; held requests get the rest of the shutdown budget.

Ray touch ``serve.replica_port_behind_haproxy``; without it ``http.ingress: haproxy``
is refused at replica start (``wanted``), since ``dsv4-haproxy`` sends HAProxy here,
unless ``DSV4_HAPROXY_TARGET=ray`` keeps HAProxy on Ray's ports cluster-wide.
"""

from __future__ import annotations

import asyncio
from typing import Any

from deployments import ray_touches, serve_env
from deployments.config.http import ReplicaPortLimits
from deployments.doors.behind_haproxy import BehindHAProxy
from deployments.doors.listener import ReplicaListener
from deployments.doors.stopping import serve_stopping, this_replica
from deployments.logs import get_logger

logger = get_logger("server")

TOUCH = "serve.replica_port_behind_haproxy"
SETTING = "the replica's own port behind HAProxy"
BIND_FIX = ("free the port, or move Ray's direct-ingress range "
            "(RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT/MAX_HTTP_PORT; the replicas' own ports "
            "run from MAX to 2*MAX-MIN-1) in every Ray process's environment")
# How long the replica waits for Serve's direct-ingress port (Serve starts that server
# right after the replica's constructor; a failure there fails the replica itself).
RAY_PORT_WAIT_S = 120.0


def wanted() -> bool:
    """Whether this replica opens its own port behind HAProxy (``DSV4_HAPROXY_TARGET``,
    logged when not); refuses (before the engine boots) a Ray without the touch, where
    ``dsv4-haproxy`` would send HAProxy to a port nobody binds."""
    if serve_env.haproxy_target() == "ray":
        logger.info("dsv4: %s=ray: HAProxy reaches this replica on Serve's direct-ingress "
                    "port, not a port of its own", serve_env.HAPROXY_TARGET_FLAG)
        return False
    if not ray_touches.present(TOUCH):
        raise RuntimeError(
            f"http.ingress=haproxy: ray touch {TOUCH} is missing in this Ray, so the "
            "replica cannot answer on the port dsv4-haproxy points HAProxy at. Fix: "
            "install the Ray dsv4-serve pins (`dsv4-serve doctor` names what changed), "
            f"or set {serve_env.HAPROXY_TARGET_FLAG}=ray in every Ray process's environment.")
    return True


class ServeCount:
    """Counts this port's requests in Serve's ongoing requests, on Serve's loop."""

    def __init__(self, replica: Any):
        from ray.serve._private.common import RequestMetadata, RequestProtocol

        self._loop = replica._event_loop
        manager = replica._metrics_manager
        self._inc, self._dec = manager.inc_num_ongoing_requests, manager.dec_num_ongoing_requests
        # Counted as direct-ingress HTTP (Serve's ingress gauges too); nothing else of
        # the metadata is read by the count.
        self._meta = RequestMetadata(request_id="dsv4-own-port",
                                     internal_request_id="dsv4-own-port",
                                     is_direct_ingress=True,
                                     _request_protocol=RequestProtocol.HTTP)

    def __call__(self, delta: int) -> None:
        self._loop.call_soon_threadsafe(self._inc if delta > 0 else self._dec, self._meta)


def serve_health(replica: Any) -> Any:
    """Serve's data-plane health answer, asked on Serve's loop (read at each call, so
    the drain gate installed on the instance is included)."""
    async def health() -> tuple[bool, str]:
        answer = asyncio.run_coroutine_threadsafe(replica._dataplane_health_check(),
                                                  replica._event_loop)
        healthy, message = await asyncio.wrap_future(answer)
        return bool(healthy), str(message)
    return health


async def ray_port(replica: Any, wait_s: float = RAY_PORT_WAIT_S) -> int:
    """Serve's direct-ingress HTTP port of this replica, once Serve has bound it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while replica._http_port is None:
        if loop.time() > deadline:
            raise RuntimeError(f"Serve's direct-ingress port of this replica was not set "
                               f"within {wait_s:g} s; HAProxy cannot reach it")
        await asyncio.sleep(0.05)
    return int(replica._http_port)


async def open_port(app: Any, limits: ReplicaPortLimits, budget_s: float) -> ReplicaListener:
    """Bind and serve ``app`` on this replica's own port behind HAProxy; the listener
    closes after Ray's draining window once Serve stops the replica."""
    replica = this_replica()
    if replica is None:
        raise RuntimeError("no Serve replica in this process: the port behind HAProxy "
                           "needs one")
    theirs = await ray_port(replica)
    port = serve_env.replica_port_for(theirs)
    if port is None:
        raise RuntimeError(f"Serve gave this replica port {theirs}, outside "
                           f"{serve_env.DIRECT_RANGE_FLAGS} as this process reads them. "
                           "Fix: set the same range in every Ray process's environment.")
    host = replica._http_options.host
    routed = BehindHAProxy(app, serve_health(replica), ServeCount(replica),
                           route_prefix=replica._route_prefix or "/")
    listener = ReplicaListener(routed, host, port, limits, setting=SETTING, shared=False,
                               fix=BIND_FIX)
    await listener.start()
    logger.info("dsv4: HAProxy reaches this replica on %s:%d (Serve's own server: %d)",
                host, port, theirs)
    stopping = serve_stopping()
    if stopping is not None:
        from ray.serve._private import constants

        listener.watch(stopping, budget_s,
                       hold_s=float(constants.RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S))
    return listener
