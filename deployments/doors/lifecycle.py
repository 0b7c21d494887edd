"""A server replica's doors over its life: opened with the app, drained, closed.

The replica composes one ``Doors``: it opens the replica's own port
(``http.replica_port``, on the proxy's host) or the port HAProxy reaches it on
(``haproxy_target``), gates Serve's ``/-/healthz`` under HAProxy (``dataplane``), follows
the controller's drain, closes on a dead engine and at shutdown. The replica keeps the
KV check and the engine; what a door does on each of those events is said here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from deployments.config import HTTPEdge
from deployments.doors import dataplane, haproxy_target
from deployments.doors.listener import ReplicaListener
from deployments.doors.stopping import serve_stopping
from deployments.logs import get_logger

logger = get_logger("server")


class Doors:
    """The ways in to one replica beside Serve's proxy, and their state."""

    def __init__(self, http: HTTPEdge, answers_http: bool, drain_timeout_s: float):
        """``answers_http``: the replica is an ingress (a P/D prefill replica is not)."""
        self._http = http
        self._drain_timeout_s = drain_timeout_s
        self.listener: ReplicaListener | None = None
        behind_haproxy = answers_http and http.ingress == "haproxy"
        self.own_port_behind_haproxy = behind_haproxy and haproxy_target.wanted()
        self._dataplane = dataplane.install() if behind_haproxy else None
        self._behind: asyncio.Task[None] | None = None  # opens the port behind HAProxy

    async def open(self, app: Any, proxy_host: Callable[[], str | None]) -> None:
        """Open the replica's own door for ``app``, if one is configured; ``proxy_host``
        is asked only for ``http.replica_port`` (``front.proxy_host``)."""
        if self._http.replica_port is not None:
            await self._open_listener(app, self._http.replica_port, proxy_host())
        elif self.own_port_behind_haproxy:  # once Serve's own server has its port
            self._behind = asyncio.get_running_loop().create_task(self._open_behind_haproxy(app))

    async def _open_behind_haproxy(self, app: Any) -> None:
        """The port HAProxy reaches this replica on (``haproxy_target``); a failure is
        logged here and fails the replica's health check (Serve replaces it)."""
        try:
            self.listener = await haproxy_target.open_port(
                app, self._http.replica_port_limits, self._drain_timeout_s)
        except Exception:
            logger.exception("dsv4: the port behind HAProxy did not open; HAProxy marks "
                             "this replica down and Serve replaces it")
            raise

    async def _open_listener(self, app: Any, port: int, host: str | None) -> None:
        """``http.replica_port``: answer HTTP here too, on the proxy's host (``listener``)."""
        if host is None:
            raise RuntimeError(
                f"http.replica_port={port}: the address Serve's proxy binds is unknown (or "
                "Serve's direct ingress is on), so the replica cannot bind the same one. "
                "Fix: remove http.replica_port, or unset RAY_SERVE_ENABLE_DIRECT_INGRESS/"
                "RAY_SERVE_ENABLE_HA_PROXY.")
        self.listener = ReplicaListener(app, host, port, self._http.replica_port_limits)
        await self.listener.start()  # a verdict comes later; drain then closes it
        stopping = serve_stopping()  # Serve began stopping us: close the port at once
        if stopping is not None:
            self.listener.watch(stopping, self._drain_timeout_s)

    async def close(self) -> None:
        """Shutdown: stop taking connections on the replica's own port, let held
        requests finish (up to the deployment's graceful shutdown time)."""
        if self._behind is not None and not self._behind.done():
            self._behind.cancel()
        if self.listener is not None:
            await self.listener.stop(self._drain_timeout_s)

    async def follow_drain(self, drained: bool, others_serving: bool) -> None:
        """A drained replica takes no new connections on its own port (or from HAProxy)
        either, unless no other replica would be left to take them (fail open, like the
        router)."""
        if self._dataplane is not None:
            self._dataplane.follow(drained and others_serving)
        if self.listener is None or self._http.ingress == "haproxy":  # the gate drains
            return
        if drained and others_serving \
                and self.listener.others_listening():  # the last one on this node stays
            self.listener.pause()
        elif not self.listener.listening:
            if drained:
                logger.warning("dsv4: drained, but no other replica serves: keeping "
                               "%s open rather than refusing every client",
                               self.listener.address)
            await self.listener.resume()

    def raise_if_broken(self) -> None:
        """Fail the health check when the port behind HAProxy did not open."""
        if self._behind is not None and self._behind.done() and not self._behind.cancelled() \
                and self._behind.exception() is not None:
            raise RuntimeError("the port behind HAProxy did not open (logged above); "
                               "HAProxy cannot reach this replica") from self._behind.exception()

    def engine_dead(self) -> None:
        """A dead engine takes no new connections."""
        if self.listener is not None:
            self.listener.engine_dead()

    async def engine_healthy(self) -> None:
        """Healthy again (a passing failure): reopen."""
        if self.listener is not None:
            await self.listener.open_for("engine")


def listening_ingress(cls: type) -> type:
    """``serve.ingress()(cls)`` whose shutdown first closes the replica's own port.

    Serve's ingress wrapper runs the ASGI app's lifespan shutdown (vLLM's drops
    ``app.state``) before the class's ``__del__``; requests held on ``http.replica_port``,
    which Serve does not count while it drains, must finish before that.
    """
    from ray import serve

    wrapped = serve.ingress()(cls)

    class ListeningIngress(wrapped):  # type: ignore[misc, valid-type]  # subclassing a class serve.ingress builds at runtime
        async def __del__(self) -> None:
            await self.dsv4_close_listener()
            await super().__del__()

    for attr in ("__name__", "__qualname__", "__module__", "__doc__"):
        setattr(ListeningIngress, attr, getattr(cls, attr))
    return ListeningIngress
