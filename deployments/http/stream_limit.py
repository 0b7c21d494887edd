"""Edge middleware: no request runs past ``http.stream_max_s`` nor idles past ``stream_idle_s``.

The app runs as a task watched against both deadlines. Over a limit the task is
cancelled (the cancellation reaches vLLM, which aborts the request in the engine)
and the client is told why: a 408 before the response started, else the stream's
last event in the route's protocol (``problem.refuse`` with ``in_stream``).
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.http.refusal import (
    Refusal,
    header,
    logger,
    refuse,
)


class _Watched:
    """What the app sent so far: started, streaming, finished, when the last chunk went."""

    def __init__(self, send: Send):
        self.send_on, self.started, self.finished, self.streaming = send, False, False, False
        self.last_chunk = time.monotonic()

    async def send(self, message: Message) -> None:
        self.last_chunk = time.monotonic()
        if message["type"] == "http.response.start":
            self.started = True
            headers = dict(message.get("headers", []))
            self.streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            self.finished = not message.get("more_body", False)
        await self.send_on(message)


class StreamLimitMiddleware:
    """See the module docstring."""

    def __init__(self, app: ASGIApp, stream_max_s: float, stream_idle_s: float):
        self.app, self.max_s, self.idle_s = app, stream_max_s, stream_idle_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        watched = _Watched(send)
        task = asyncio.ensure_future(self.app(scope, receive, watched.send))
        started = time.monotonic()
        try:
            while True:
                deadline = started + self.max_s
                if watched.streaming:
                    deadline = min(deadline, watched.last_chunk + self.idle_s)
                # Wake at least every idle period: a stream may start while we wait.
                wait_s = min(max(0.0, deadline - time.monotonic()), self.idle_s)
                done, _ = await asyncio.wait({task}, timeout=wait_s)
                if done:
                    break
                if time.monotonic() >= deadline:
                    await self._stop(scope, task, watched, started)
                    return
        except asyncio.CancelledError:
            task.cancel()
            raise
        task.result()  # the app's own exception: the scrubber answers it

    async def _stop(self, scope: Scope, task: asyncio.Future[None], watched: _Watched,
                    started: float) -> None:
        """Cancel the app (the engine aborts) and tell the client why."""
        task.cancel()
        await asyncio.wait({task})
        request_id = header(scope, b"x-request-id")
        if not task.cancelled() and task.exception() is not None:
            logger.error("dsv4: request %s failed while being stopped: %r", request_id,
                         task.exception())
        took = time.monotonic() - started
        limit = (f"no chunk for {self.idle_s:g} s (http.stream_idle_s)"
                 if took < self.max_s else
                 f"it ran {took:.0f} s, the limit http.stream_max_s is {self.max_s:g} s")
        logger.warning("dsv4: request %s stopped: %s", request_id, limit)
        if watched.finished:
            return
        refusal = Refusal(408, f"the request was stopped: {limit}. Fix: ask for fewer "
                          "tokens.", "timeout_error", "stream_limit")
        await refuse(scope, watched.send_on, refusal, in_stream=watched.started)
