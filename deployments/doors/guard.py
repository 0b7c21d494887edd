"""The replica port's bounds below the app: header deadline, connection cap, the cut.

Why: uvicorn arms its keep-alive timer only after a response and ``limit_concurrency``
answers 503 to a *request*, so a client that connects and never sends (or trickles)
its headers holds a file descriptor in the engine process forever, before any key
is checked (issue 32). And ``Server.force_exit`` cancels nothing: a request still
held when the replica's shutdown budget ends would die in ``ray.kill`` with no word.

How: ``limited_protocol`` subclasses the HTTP protocol uvicorn would pick itself
(``uvicorn.protocols.http.auto``; uvicorn's ``Config(http=<class>)`` takes a class):
a connection over ``max_connections`` gets a 503 and is closed at once; a connection
must deliver a request's full headers (and at most ``MAX_HEADER_BYTES``) within
``header_timeout_s`` of opening, or of the first byte after a response. Idle
keep-alive connections close after uvicorn's ``timeout_keep_alive``.
``HeldRequests`` wraps the ASGI app and can cut every request it holds: a started
event stream ends with an error event (OpenAI's ``data: {"error": ...}``, Anthropic's
``event: error`` on ``/v1/messages``), an unstarted response is a 503.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from deployments.config.http import ReplicaPortLimits
from deployments.logs import get_logger

logger = get_logger("listener")

# Request line + headers of one request; httptools itself has no bound.
MAX_HEADER_BYTES = 64 << 10
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n"
         b"retry-after: 1\r\nconnection: close\r\ncontent-length: 39\r\n\r\n"
         b"too many connections to this replica\r\n\r\n")
_HEADERS_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                      b"connection: close\r\ncontent-length: 0\r\n\r\n")


def limited_protocol(limits: ReplicaPortLimits) -> type[asyncio.Protocol]:
    """uvicorn's own HTTP protocol class with a connection cap and a header deadline."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol
    # httptools reports where a message's headers end; h11 (the fallback) bounds
    # incomplete headers itself (``max_incomplete_event_size``, 16 KiB).
    _COUNTS_HEADERS = hasattr(base, "on_headers_complete")

    class LimitedProtocol(base):
        transport: Any  # uvicorn's; None once a refused connection is dropped
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0
        # A request's headers are in and its body is still arriving. After an early
        # answer (a 413 before the body is read) that body keeps coming on a cycle
        # whose response is complete: its bytes are not the next request's headers.
        _in_body = False

        def connection_made(self, transport: asyncio.Transport) -> None:
            if len(self.server_state.connections) >= limits.max_connections:
                # Not added to uvicorn's connections: nothing of it outlives this call.
                transport.write(_BUSY)
                transport.close()
                self.transport = None
                return
            super().connection_made(transport)
            self._arm()

        def on_headers_complete(self) -> None:
            self._in_body = True
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()

        def data_received(self, data: bytes) -> None:
            if self.transport is None:
                return
            if self._header_timer is None and self._between_requests():
                # The first byte of a next request on a kept-alive connection, or the
                # rest of a body after an early answer: either must arrive in time.
                self._arm()
            counted = _COUNTS_HEADERS and not self._in_body
            if counted:
                self._header_bytes += len(data)
            super().data_received(data)
            if self._header_timer is None:
                return
            if not self._between_requests():
                self._disarm()  # the headers are in: the edge's body deadline takes over
            elif (counted and not self._in_body and self._header_bytes > MAX_HEADER_BYTES
                  and not self.transport.is_closing()):
                self.transport.write(_HEADERS_TOO_LARGE)
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self.transport is not None:
                super().connection_lost(exc)

        def _between_requests(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is None or cycle.response_complete

        def _arm(self) -> None:
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    LimitedProtocol.__name__ = LimitedProtocol.__qualname__ = f"Limited{base.__name__}"
    return LimitedProtocol


class HeldRequests:
    """The ASGI app, with the requests it holds known and cuttable (``cut``)."""

    def __init__(self, app: Any):
        self._app = app
        self._held: dict[asyncio.Task[Any], _Held] = {}
        self._why = ""

    @property
    def count(self) -> int:
        return len(self._held)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        task = asyncio.current_task()
        assert task is not None
        held = self._held[task] = _Held(scope, send)
        try:
            await self._app(scope, receive, held.send)
        except asyncio.CancelledError:
            if not held.cut:
                raise
            # Our own cancellation (``cut``): the request ends here with a word.
            if hasattr(task, "uncancel"):  # Python 3.11+: this cancel is handled
                task.uncancel()
            await held.finish(self._why)
        finally:
            self._held.pop(task, None)

    def cut(self, why: str) -> int:
        """Cancel every held request; each ends with an error event or a 503."""
        self._why = why
        for task, held in list(self._held.items()):
            held.cut = True
            task.cancel()
        return len(self._held)


class _Held:
    """One request: whether its response started, and as what."""

    def __init__(self, scope: dict[str, Any], send: Any):
        self._send = send
        self.anthropic = str(scope.get("path", "")).startswith("/v1/messages")
        self.started = self.stream = self.ended = self.cut = False

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.stream = any(k.lower() == b"content-type" and
                              v.lower().startswith(b"text/event-stream")
                              for k, v in message.get("headers", []))
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            self.ended = True
        await self._send(message)

    async def finish(self, why: str) -> None:
        if self.ended:
            return
        if not self.started:
            body = json.dumps({"error": {"message": why, "type": "server_shutdown",
                                         "param": None, "code": 503}}).encode()
            await self._send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"retry-after", b"1"),
                (b"connection", b"close")]})
            await self._send({"type": "http.response.body", "body": body})
            return
        if not self.stream:
            # A half-sent JSON body cannot carry an error: end the connection abruptly.
            raise asyncio.CancelledError(why)
        await self._send({"type": "http.response.body", "body": self._event(why)})

    def _event(self, why: str) -> bytes:
        if self.anthropic:
            data = {"type": "error", "error": {"type": "overloaded_error", "message": why}}
            return b"event: error\ndata: " + json.dumps(data).encode() + b"\n\n"
        data = {"error": {"message": why, "type": "server_shutdown", "param": None,
                          "code": 503}}
        return b"data: " + json.dumps(data).encode() + b"\n\n"
