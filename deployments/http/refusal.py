"""The edge's one error model: every error body, in the protocol of the route it answers.

OpenAI's routes answer ``{"error": {"message", "type", "param", "code"}}``;
Anthropic's (``/v1/messages*``) answer ``{"type": "error", "error": {"type",
"message"}}``, and their streams carry ``event: error``. Every refusal of every
edge middleware is a ``Refusal`` sent by ``refuse`` (one place to count them by
``reason``); every 5xx a client sees is ``internal_error`` (a request id, nothing
internal) in the route's own shape, as a body or as a stream event.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from starlette.types import ASGIApp, Receive, Scope, Send

from deployments.http import timing
from deployments.logs import get_logger

logger = get_logger("edge")

Protocol = Literal["openai", "anthropic"]
# Why the edge refused: the label refusals are counted by.
Reason = Literal["bounds", "keys", "body_deadline", "drain", "routes", "stream_limit",
                 "overload", "starting"]

ANTHROPIC_PREFIX = "/v1/messages"
# Anthropic's error types for an HTTP status (docs.anthropic.com, "Errors").
_ANTHROPIC_KIND = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error",
                   405: "invalid_request_error", 408: "timeout_error",
                   413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
# Anthropic error types a client caused: left as written in a stream.
ANTHROPIC_CLIENT_KINDS = frozenset(v for k, v in _ANTHROPIC_KIND.items() if k < 500)

# A key our own routes set in the ASGI scope when their 5xx body is public as written
# (the edge's refusals, the redacted report of ``/v1/kv-spec``). Server-side only: no
# client can set it; a middleware that copies the scope loses it (then scrubbed).
PUBLIC_ERROR_KEY = "dsv4.public_error"


def mark_public_error(scope: Scope) -> None:
    """Let this request's 5xx body out as written (it names nothing internal)."""
    scope[PUBLIC_ERROR_KEY] = True


def route_path(scope: Scope) -> str:
    """The path inside the application (Serve passes the route prefix as root_path)."""
    path, root = scope.get("path", "/"), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path.rstrip("/") or "/"


def protocol_of(scope: Scope) -> Protocol:
    """Anthropic's error shape on ``/v1/messages*``, OpenAI's everywhere else."""
    return "anthropic" if route_path(scope).startswith(ANTHROPIC_PREFIX) else "openai"


def error_payload(status: int, message: str, kind: str, param: str | None = None,
                  protocol: Protocol = "openai") -> dict[str, Any]:
    """The error object of ``protocol`` (the body, or a stream event's data)."""
    if protocol == "anthropic":
        kind = _ANTHROPIC_KIND.get(status, "api_error" if status >= 500 else kind)
        return {"type": "error", "error": {"type": kind, "message": message}}
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_body(status: int, message: str, kind: str, param: str | None = None,
               protocol: Protocol = "openai") -> bytes:
    return json.dumps(error_payload(status, message, kind, param, protocol)).encode()


def internal_message(request_id: str) -> str:
    return (f"internal server error (request id {request_id}); the details are in the "
            "server log under that id.")


def internal_error_body(status: int, request_id: str, protocol: Protocol = "openai") -> bytes:
    return error_body(status, internal_message(request_id), "internal_server_error",
                      protocol=protocol)


def error_event(status: int, message: str, kind: str, protocol: Protocol) -> bytes:
    """The last event of a stream the edge ends: OpenAI's ``data:`` + ``[DONE]``, or
    Anthropic's ``event: error``."""
    data = error_body(status, message, kind, protocol=protocol)
    if protocol == "anthropic":
        return b"event: error\ndata: " + data + b"\n\n"
    return b"data: " + data + b"\n\ndata: [DONE]\n\n"


class Refusal(Exception):
    """An answer the edge gives instead of the app: status, message with the fix,
    error type, the field it is about, extra headers and the ``reason`` it counts as."""

    def __init__(self, status: int, message: str, kind: str, reason: Reason,
                 param: str | None = None, headers: list[tuple[bytes, bytes]] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.reason = status, message, kind, reason
        self.param, self.headers = param, headers or []


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def send_json(send: Send, status: int, body: bytes, request_id: str | None,
                    extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), *(extra or [])]
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def refuse(scope: Scope, send: Send, refusal: Refusal, in_stream: bool = False) -> None:
    """Send ``refusal`` in the route's protocol: the one way the edge refuses.

    ``in_stream``: the response already started as a stream; the refusal is its last
    event (``error_event``).
    """
    mark_public_error(scope)
    timing.note_refusal(scope, refusal.reason)  # counted by reason (observe.series.REFUSED)
    logger.debug("dsv4: refused %s (%s): %d", route_path(scope), refusal.reason,
                 refusal.status)
    if in_stream:
        event = error_event(refusal.status, refusal.message, refusal.kind,
                            protocol_of(scope))
        await send({"type": "http.response.body", "body": event, "more_body": False})
        return
    body = error_body(refusal.status, refusal.message, refusal.kind, refusal.param,
                      protocol_of(scope))
    await send_json(send, refusal.status, body, header(scope, b"x-request-id"),
                    refusal.headers)


class RefusingMiddleware:
    """Base of the edge's middlewares: ``handle`` may raise ``Refusal``; only HTTP."""

    app: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self.handle(scope, receive, send)
        except Refusal as refusal:
            await refuse(scope, send, refusal)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError
