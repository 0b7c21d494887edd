"""The store behind vLLM's ``OpenAIServingResponses``, on one replica.

``bind(serving, store)`` swaps the instance's dicts for ``views.OwnedView``s and wraps
the three entry points (the touch is documented and probed in
``dsv4_patch.responses_touch``):

* ``create_responses``: loads ``previous_response_id`` (response and input messages)
  from the store first, so any replica continues any conversation; saves what vLLM
  stored before the answer leaves -- the full response, the ``queued`` record of a
  background run, or, streamed, before ``response.completed`` is sent. A save that
  fails fails the request (503, or an ``error`` event in a stream); a background run
  whose first record cannot be saved is cancelled.
* ``retrieve_responses`` / ``cancel_responses``: load from the store, then vLLM answers;
  a cancel is saved, and the replica running that background run sees it within
  ``cancel_poll_s`` (``poll_cancels``) and cancels its task. Replaying a background
  run's event stream (``stream=true``) stays with the replica that runs it: the events
  are not stored (one write per token); elsewhere the answer is a 400 that says so.
* background runs save their final record when they end (a stored cancel wins).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

from deployments.logs import get_logger
from deployments.responses.store import QuotaExceeded, ResponsesStore, StoreError
from deployments.responses.views import OWNER, Key, OwnedView, mark_store_error_public
from dsv4_patch.responses_touch import READ as TOUCH

logger = get_logger("responses")

LOCAL_COPIES = 1024  # clean local copies kept per view (what a request loaded)
EVENT_STREAMS = 256  # background event streams replayable on the replica running them


class StoreBinding:
    """One replica's ``OpenAIServingResponses`` backed by ``store``."""

    def __init__(self, serving: Any, store: ResponsesStore, cancel_poll_s: float,
                 on_error: Callable[[str], None] = lambda _: None) -> None:
        self.serving, self.store, self.cancel_poll_s = serving, store, cancel_poll_s
        self.on_error = on_error
        module = sys.modules[type(serving).__module__]
        self._error_type, self._response_type = module.ErrorResponse, module.ResponsesResponse
        self._running: dict[str, str] = {}  # background response id -> owner
        pinned = self._running.__contains__
        self.responses: OwnedView[Any] = OwnedView(LOCAL_COPIES, pinned)
        self.messages: OwnedView[Any] = OwnedView(LOCAL_COPIES, pinned)
        self.events: OwnedView[Any] = OwnedView(EVENT_STREAMS, pinned, saved=False)

    def install(self) -> None:
        """Swap the dicts and entry points of this instance (probed first)."""
        problem = TOUCH.probe()
        if problem is not None:
            raise RuntimeError(f"http.responses_store is on but vLLM's Responses state "
                               f"cannot be moved to the shared store: {problem}. Fix: run a "
                               f"vLLM release dsv4_patch.responses_touch supports "
                               f"({TOUCH.affected}), or set http.responses_store: false.")
        s = self.serving
        if getattr(s, "use_harmony", False):
            raise RuntimeError("http.responses_store: gpt-oss (harmony) messages are not "
                               "stored by dsv4-serve. Fix: set http.responses_store: false.")
        s.response_store, s.msg_store, s.event_store = self.responses, self.messages, \
            self.events
        self._create, self._retrieve = s.create_responses, s.retrieve_responses
        self._cancel = s.cancel_responses
        s.create_responses, s.retrieve_responses = self.create, self.retrieve
        s.cancel_responses = self.cancel
        s._run_background_request = self._background(s._run_background_request)
        s._run_background_request_stream = self._background(s._run_background_request_stream)

    # ------------------------------------------------------------ store <-> views

    async def _load(self, key: Key) -> None:
        record = await self.store.get(*key)
        response = None if record is None or record.response is None else \
            self._response_type.model_validate_json(record.response)
        self.responses.load(key, response)
        messages = None if record is None or record.messages is None else \
            json.loads(record.messages)
        self.messages.load(key, messages)

    async def _save(self, key: Key, force: bool = False) -> None:
        """What vLLM wrote for ``key`` (or all of it, with ``force``), in one write."""
        messages = self.messages.take(key, force)
        response = self.responses.take(key, force)
        if messages is None and response is None:
            return
        await self.store.put_record(
            *key, None if messages is None else _dump_messages(messages),
            None if response is None else response.model_dump_json(),
            None if response is None else response.status, keep_cancelled=True)

    def _forget(self, key: Key) -> None:
        self.responses.drop(key)
        self.messages.drop(key)

    def _abandon(self, key: Key) -> None:
        """What vLLM wrote for a request that ended without a saved answer."""
        self.responses.discard(key)
        self.messages.discard(key)

    def _failed(self, op: str, exc: StoreError) -> Any:
        if isinstance(exc, QuotaExceeded):  # the client's record, not the store's health
            return self.serving.create_error_response(
                str(exc), err_type="BadRequestError", param="store",
                status_code=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        self.on_error(op)
        logger.error("dsv4: Responses store %s failed: %s", op, exc)
        mark_store_error_public()  # names the store and the fix, nothing internal
        return self.serving.create_error_response(
            f"the Responses store is unavailable ({exc}); nothing was stored. Retry later.",
            err_type="ServiceUnavailableError", status_code=HTTPStatus.SERVICE_UNAVAILABLE)

    # ------------------------------------------------------------ entry points

    async def create(self, request: Any, raw_request: Any = None) -> Any:
        owner = OWNER.get()
        previous = request.previous_response_id
        try:
            if previous is not None:
                await self._load((owner, previous))
        except StoreError as exc:
            return self._failed("read", exc)
        key = (owner, request.request_id)
        try:
            result = await self._create(request, raw_request)
        except BaseException:  # cancelled (client gone, stream_max_s) or failed
            self._abandon(key)
            raise
        finally:
            if previous is not None:
                self._forget((owner, previous))
        if isinstance(result, self._error_type):
            self._abandon(key)
            return result
        if request.background or isinstance(result, self._response_type):
            task = self.serving.background_tasks.get(request.request_id)
            if task is not None and not task.done():
                self._running[request.request_id] = owner  # its copies stay local
                task.add_done_callback(lambda _: self._running.pop(request.request_id, None))
            try:
                await self._save(key)
            except StoreError as exc:
                if task is not None:
                    task.cancel()
                self._running.pop(request.request_id, None)
                self._abandon(key)
                return self._failed("write", exc)
            finally:
                self._forget(key)
            return result
        return _Stream(self._stream(key, result), lambda: self._abandon(key))

    async def _stream(self, key: Key, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Pass vLLM's events on; save the response before ``response.completed``."""
        try:
            async for event in events:
                if getattr(event, "type", None) == "response.completed":
                    try:
                        await self._save(key)
                    except StoreError as exc:
                        self._failed("write", exc)
                        yield _error_event(event, exc)
                        return
                yield event
        finally:
            self._abandon(key)  # saved before response.completed, or never complete

    async def retrieve(self, response_id: str, starting_after: int | None = None,
                       stream: bool | None = False) -> Any:
        async def run(key: Key) -> Any:
            if stream and self.responses.get(response_id) is not None \
                    and response_id not in self.events:
                return self.serving.create_error_response(
                    f"response {response_id}'s event stream is replayed only by the replica "
                    "running it, and it does not run here. Fix: retrieve it without "
                    "stream=true (its stored state), or stream the create itself.",
                    param="stream")
            return await self._retrieve(response_id, starting_after=starting_after,
                                        stream=stream)

        return await self._loaded(response_id, run)

    async def cancel(self, response_id: str) -> Any:
        async def run(key: Key) -> Any:
            try:
                result = await self._cancel(response_id)
                if isinstance(result, self._response_type) and result.status == "cancelled":
                    await self.store.put_response(*key, result.model_dump_json(), "cancelled")
                return result
            except StoreError as exc:
                return self._failed("write", exc)

        return await self._loaded(response_id, run)

    async def _loaded(self, response_id: str, run: Callable[[Key], Awaitable[Any]]) -> Any:
        """``run(key)`` with the caller's stored record loaded and forgotten after; a
        failed read is answered as its error response."""
        key = (OWNER.get(), response_id)
        try:
            await self._load(key)
        except StoreError as exc:
            return self._failed("read", exc)
        try:
            return await run(key)
        finally:
            self._forget(key)

    def _background(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """A background run that saves its final record (a stored cancel wins)."""
        async def background(request: Any, *args: Any, **kwargs: Any) -> None:
            key = (OWNER.get(), request.request_id)
            self._running[request.request_id] = key[0]
            try:
                await run(request, *args, **kwargs)
            finally:
                self._running.pop(request.request_id, None)
                try:
                    await self._save(key, force=True)
                except StoreError as exc:
                    self.on_error("write")
                    logger.error("dsv4: a background response's final state was not "
                                 "stored (%s); the store keeps its last saved state", exc)
                self._forget(key)  # its event stream stays replayable (bounded)
        return background

    # ------------------------------------------------------------ cancels elsewhere

    async def poll_cancels(self) -> int:
        """Cancel each local background task whose stored record is ``cancelled``."""
        keys = [(owner, rid) for rid, owner in list(self._running.items())]
        if not keys:
            return 0
        found = await self.store.statuses(keys)
        cancelled = 0
        for (_, rid), status in found.items():
            task = self.serving.background_tasks.get(rid)
            if status == "cancelled" and task is not None and not task.done():
                task.cancel()
                cancelled += 1
        return cancelled

    async def run_poller(self, on_size: Callable[[int], None],
                         size_every_s: float = 10.0) -> None:
        """Forever: cancels made elsewhere every ``cancel_poll_s``; the store's size."""
        since_size = size_every_s
        while True:
            try:
                await self.poll_cancels()
                if since_size >= size_every_s:
                    on_size(await self.store.size())
                    since_size = 0.0
            except StoreError as exc:
                self.on_error("poll")
                logger.warning("dsv4: Responses store poll failed: %s", exc)
            except Exception:  # a bug must not end cancels silently: logged, next round
                self.on_error("poll")
                logger.exception("dsv4: Responses store poll failed unexpectedly; polling "
                                 "goes on")
            await asyncio.sleep(self.cancel_poll_s)
            since_size += self.cancel_poll_s


class _Stream:
    """A stream's events whose ``abandon`` runs however it ends: finished, closed, or
    dropped before its first event (an async generator never started runs no
    ``finally``; vLLM's ``msg_store`` copy would stay forever)."""

    def __init__(self, events: AsyncIterator[Any], abandon: Callable[[], None]) -> None:
        self._events, self._abandon = events, abandon

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._events.__anext__()
        except BaseException:
            self._abandon()
            raise

    async def aclose(self) -> None:
        self._abandon()
        await self._events.aclose()  # type: ignore[attr-defined]  # an async generator

    def __del__(self) -> None:
        self._abandon()


def _dump_messages(messages: Any) -> str:
    """vLLM's ``msg_store`` entry (chat message dicts, possibly holding pydantic parts)."""
    from pydantic import TypeAdapter

    return TypeAdapter(Any).dump_json(messages).decode()


def _error_event(completed: Any, exc: StoreError) -> Any:
    """An OpenAI ``error`` stream event in place of ``response.completed``."""
    from openai.types.responses import ResponseErrorEvent

    return ResponseErrorEvent(
        type="error", param=None,
        code="store_quota" if isinstance(exc, QuotaExceeded) else "store_unavailable",
        sequence_number=getattr(completed, "sequence_number", 0),
        message=str(exc) if isinstance(exc, QuotaExceeded) else
        f"the Responses store is unavailable ({exc}); this response was not stored.")
