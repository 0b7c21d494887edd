"""Edge middleware: in-flight slots, and the body read within its bounds before vLLM sees it.

A request on an admitted route (every POST, and the GETs that cost:
``routes.Route.admitted``) takes one of this replica's ``Slots`` *before* its body is
read and holds it until the app is done: an upload in progress holds a slot, so a key
holder cannot park any number of slow uploads. Full: **503 + Retry-After**. The body
must arrive within ``http.body_timeout_s`` (**408**) and stay within
``http.max_body_bytes`` (**413**); then ``parsed.judge`` judges it on the values vLLM's
request model makes of it (**400** naming the field) and the app gets it replayed
(re-encoded with those values when they differ from what was sent), with the client's
own later messages (so a disconnect still aborts the generation).

A Responses request whose ``background`` vLLM reads as true (``true``, ``1``, ``"yes"``
...) with the store on returns at once while vLLM
runs the generation in a task (``OpenAIServingResponses.background_tasks``, keyed by
the response id = the request's ``request_id``, which the edge assigns): its slot is
held until that task ends, and the task is cancelled at ``http.stream_max_s``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.config import HTTPEdge
from deployments.http import routes
from deployments.http.bounds import STORE_SETTING
from deployments.http.parsed import judge
from deployments.http.refusal import (
    Refusal,
    RefusingMiddleware,
    header,
    logger,
)
from deployments.http.route_gate import ROUTE_KEY

# response id -> vLLM's background task for it (None: none running).
BackgroundTasks = Callable[[str], "asyncio.Future[object] | None"]


@dataclass
class Slots:
    """This replica's in-flight requests against its share of ``http.max_in_flight``."""

    limit: int
    note: str = ""  # how the limit was derived, for the 503 message
    retry_after_s: int = 1
    in_flight: int = 0

    def take(self) -> None:
        if self.in_flight >= self.limit:
            raise Refusal(503, f"the server is at its limit of {self.limit} requests in "
                          f"flight (http.max_in_flight{self.note}). Fix: retry after "
                          f"{self.retry_after_s} s.", "overloaded", "overload",
                          headers=[(b"retry-after", str(self.retry_after_s).encode())])
        self.in_flight += 1

    def give(self) -> None:
        self.in_flight -= 1


class _ClientGone(Exception):
    """The client went away before its body arrived: nobody to answer."""


class AdmissionMiddleware(RefusingMiddleware):
    """See the module docstring."""

    def __init__(self, app: ASGIApp, settings: HTTPEdge, slots: Slots,
                 background_tasks: BackgroundTasks | None = None):
        self.app, self.settings, self.slots = app, settings, slots
        self.background_tasks = background_tasks
        self._watchers: set[asyncio.Task[None]] = set()

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = scope.get(ROUTE_KEY)
        if route is None or not route.admitted:
            await self.app(scope, receive, send)
            return
        self.slots.take()
        held = True
        try:
            if not route.body:
                await self.app(scope, receive, send)
                return
            raw = await read_body(scope, receive, self.settings)
            judged = judge(raw, self.settings, route)
            if judged.problem:
                raise Refusal(400, judged.problem[1], "invalid_request_error", "bounds",
                              param=judged.problem[0])
            raw, background_id = self._assign_id(route, judged.raw, judged.body)
            started = time.monotonic()
            await self.app(scope, replay(raw, receive), send)
            task = self._background(background_id)
            if task is not None and background_id is not None:  # a task has an id
                held = False  # the watcher gives the slot back when the task ends
                watcher = asyncio.ensure_future(self._hold(task, background_id, started))
                self._watchers.add(watcher)
                watcher.add_done_callback(self._watchers.discard)
        except _ClientGone:
            return
        finally:
            if held:
                self.slots.give()

    def _assign_id(self, route: routes.Route, raw: bytes,
                   body: object) -> tuple[bytes, str | None]:
        """With the store on, a Responses create gets its id from the edge (a client's
        ``request_id`` is refused); returns the id of a background run, else None.
        ``body`` holds vLLM's coerced values (``background`` a bool when it coerces)."""
        if not (route.stateful and route.body and self.settings.responses_store
                and route.path == routes.RESPONSES_ROUTE):
            return raw, None
        if not isinstance(body, dict):
            return raw, None
        if "request_id" in body:
            raise Refusal(400, "request_id is assigned by this server while it stores "
                          f"responses ({STORE_SETTING}): a response id is not the client's "
                          "to choose. Fix: remove request_id.", "invalid_request_error",
                          "bounds", param="request_id")
        if body.get("background") is not True:
            return raw, None
        body["request_id"] = f"resp_{uuid.uuid4().hex}"
        return json.dumps(body).encode(), body["request_id"]

    def _background(self, response_id: str | None) -> asyncio.Future[object] | None:
        if response_id is None or self.background_tasks is None:
            return None
        task = self.background_tasks(response_id)
        return task if task is not None and not task.done() else None

    async def _hold(self, task: asyncio.Future[object], response_id: str,
                    started: float) -> None:
        """Hold the slot while the background run lasts; cancel it at ``stream_max_s``."""
        try:
            left = self.settings.stream_max_s - (time.monotonic() - started)
            done, _ = await asyncio.wait({task}, timeout=max(0.0, left))
            if not done:
                logger.warning("dsv4: background response %s ran past http.stream_max_s="
                               "%gs: cancelled", response_id, self.settings.stream_max_s)
                task.cancel()
                await asyncio.wait({task}, timeout=self.settings.stream_idle_s)
        finally:
            self.slots.give()


async def read_body(scope: Scope, receive: Receive, settings: HTTPEdge) -> bytes:
    """The whole body within ``http.body_timeout_s``, refusing (413) as soon as it is known
    to exceed ``http.max_body_bytes``: a slow upload never holds its connection forever."""
    limit = settings.max_body_bytes
    declared = header(scope, b"content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    try:
        return await asyncio.wait_for(_receive_all(receive, limit), settings.body_timeout_s)
    except asyncio.TimeoutError:
        raise Refusal(408, f"the request body did not arrive within "
                      f"{settings.body_timeout_s:g} s (http.body_timeout_s). Fix: send the "
                      "body at once.", "timeout_error", "body_deadline") from None


async def _receive_all(receive: Receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _too_large(size: int, limit: int) -> Refusal:
    return Refusal(413, f"the body has at least {size} bytes, above this server's limit "
                   f"http.max_body_bytes={limit}. Fix: send a smaller request.",
                   "invalid_request_error", "bounds")


def replay(raw: bytes, receive: Receive) -> Receive:
    """A receive that yields the buffered body once, then the client's own messages."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replayed
