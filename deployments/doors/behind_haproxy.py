"""The app as HAProxy reaches a replica's own port: Serve's health answer, Serve's count.

Why: behind HAProxy the replica serves the hardened app on a port of its own
(``deployments.doors.haproxy_target``) instead of Serve's direct-ingress server. Two
things HAProxy and Serve relied on that server for must still hold there:

* HAProxy's health check (``GET /-/healthz``, no key) decides the rotation: it must
  answer what Serve's data-plane health answers (503 while the replica shuts down, its
  engine fails, or the KV-spec check drains it), not whether this socket is open.
* Serve's autoscaler and graceful drain count the replica's ongoing requests: every
  request on this port is counted in for as long as it is held.

How: an ASGI wrapper around the app. ``health`` and ``count`` are given by the caller
(they cross into Serve's own event loop); this module imports neither Ray nor vLLM.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from deployments.logs import get_logger

logger = get_logger("listener")

HEALTH_PATH = "/-/healthz"  # Ray 2.60 HAProxy's http_health_check_path default
# HAProxy's check would time out on its own; answering first says why.
HEALTH_TIMEOUT_S = 2.0
Health = Callable[[], Awaitable[tuple[bool, str]]]
Count = Callable[[int], None]


class BehindHAProxy:
    """``app`` with ``/-/healthz`` answered by ``health`` and every other HTTP request
    counted (``count(+1)`` as it arrives, ``count(-1)`` when it ends, however).

    HAProxy forwards the whole path; an app under a ``route_prefix`` other than ``/``
    is mounted there as Serve mounts it (``root_path``), and a path outside it is a 404.
    """

    def __init__(self, app: Any, health: Health, count: Count, route_prefix: str = "/"):
        self._app = app
        self._health = health
        self._count = count
        self._prefix = "" if route_prefix in ("", "/") else route_prefix.rstrip("/")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path == HEALTH_PATH:
            await self._answer_health(send)
            return
        if self._prefix:
            if path != self._prefix and not path.startswith(self._prefix + "/"):
                await _text(send, 404, f"Path {path!r} is not under this app's route "
                            f"prefix {self._prefix!r}.")
                return
            scope = dict(scope, root_path=scope.get("root_path", "") + self._prefix)
        self._count(1)
        try:
            await self._app(scope, receive, send)
        finally:
            self._count(-1)

    async def _answer_health(self, send: Any) -> None:
        try:
            healthy, message = await asyncio.wait_for(self._health(), HEALTH_TIMEOUT_S)
        except TimeoutError:
            healthy, message = False, f"health check took over {HEALTH_TIMEOUT_S:g} s"
            logger.warning("dsv4: Serve's health answer for HAProxy took over %g s; "
                           "answering 503", HEALTH_TIMEOUT_S)
        await _text(send, 200 if healthy else 503, message)


async def _text(send: Any, status: int, message: str) -> None:
    body = message.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
