"""Stored Responses on a fleet: a follow-up reaches the replica that holds the response.

vLLM keeps stored responses, background runs and ``previous_response_id`` state in the
process that created them (``OpenAIServingResponses``'s dicts), and Serve's proxy picks
a replica from the request line, before any body is read. With
``http.responses_store`` on, the edge therefore names the holder in every response id
it lets vLLM create (``routes.tagged_response_id``: vLLM takes the request's
``request_id`` as the response id), and a follow-up that lands elsewhere -- retrieve,
cancel, or a create with ``previous_response_id`` -- is relayed to the holder:

1. the answering replica checks the holder's Serve replica actor is alive (the
   ``serve.replica_ids`` touch); if not, the edge answers 404 naming the lost replica;
2. it calls its own deployment through a ``DeploymentHandle``, method
   ``RELAY_METHOD``, streaming, with the holder's id as ``TARGET_KWARG``;
   ``deployments.serving.router.KVSpecRouter`` routes such a call to that replica only;
3. the holder runs the same HTTP request through its own hardened app (edge
   included: keys and bounds are judged again there) and streams the ASGI messages
   back, which the first replica sends on unchanged.

No body is read in Ray's proxy; the relay costs one handle call per follow-up.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray import serve

from deployments.control.controller import alive_replica_ids
from deployments.http.edge import ResponseHolderGone
from deployments.http.routes import RELAYED_HEADER
from deployments.logs import get_logger
from deployments.serving.names import RELAY_METHOD, TARGET_KWARG

logger = get_logger("relay")

# Scope keys that cross processes: plain values only (no app, state or extensions).
_SCOPE_KEYS = ("type", "http_version", "method", "scheme", "path", "raw_path",
               "query_string", "root_path", "headers", "client", "server")

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]],
                    Callable[[dict[str, Any]], Awaitable[None]]], Awaitable[None]]


def portable_scope(scope: dict[str, Any]) -> dict[str, Any]:
    """The parts of an HTTP scope another process can rebuild the request from."""
    out = {key: scope[key] for key in _SCOPE_KEYS if key in scope}
    out["headers"] = [*[(k, v) for k, v in scope.get("headers", []) if k != RELAYED_HEADER],
                      (RELAYED_HEADER, b"1")]
    out["asgi"] = {"version": "3.0"}
    return out


class Relay:
    """The sending side, one per replica: ``send_to(holder, scope, body)`` streams the
    holder's ASGI messages."""

    def __init__(self) -> None:
        ctx = serve.get_replica_context()
        self.own_id = ctx.replica_id.unique_id
        self._app, self._deployment = ctx.app_name, ctx.deployment
        self._handle: Any = None

    async def send_to(self, holder: str, scope: dict[str, Any],
                      body: bytes) -> AsyncIterator[dict[str, Any]]:
        alive = await asyncio.to_thread(alive_replica_ids, self._app, self._deployment)
        if holder not in alive:
            raise ResponseHolderGone(holder)
        if self._handle is None:
            self._handle = serve.get_deployment_handle(self._deployment, self._app).options(
                method_name=RELAY_METHOD, stream=True)
        logger.info("dsv4: relaying %s %s to replica %s", scope.get("method"),
                    scope.get("path"), holder)
        async for message in self._handle.remote(portable_scope(scope), body,
                                                 **{TARGET_KWARG: holder}):
            yield message


async def serve_relayed(app: ASGIApp, scope: dict[str, Any],
                        body: bytes) -> AsyncIterator[dict[str, Any]]:
    """The holder's side: run one relayed request through ``app``; yield what it sends."""
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the relaying replica cancels us on disconnect
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await queue.put(dict(message))

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await queue.put(None)

    task = asyncio.ensure_future(run())
    try:
        while (message := await queue.get()) is not None:
            yield message
        await task
    finally:
        task.cancel()
