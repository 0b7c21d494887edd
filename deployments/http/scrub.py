"""Outermost edge middleware: a request id on every request, and no internals in any 5xx.

Every 5xx body the app sends, and every server-error event inside a stream (OpenAI's
``data: {"error": ...}``, Anthropic's ``event: error`` / ``data: {"type": "error"}``,
the Responses API's ``{"type": "error", "code": ...}``), leaves with only a request id
in the route's own protocol (``deployments.http.refusal``); what it said goes to the
log. An exception that escapes the app becomes such a 500. Ray's errors name pids and
IPs, vLLM's catch-all handler returns ``str(exc)`` and its Anthropic stream quotes
pydantic's message: none of it reaches a client. The edge's own refusals are marked
public (``problem.refuse``) and go out as written.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.http.refusal import (
    ANTHROPIC_CLIENT_KINDS,
    PUBLIC_ERROR_KEY,
    Protocol,
    error_payload,
    header,
    internal_error_body,
    internal_message,
    logger,
    protocol_of,
)

_SSE_DATA = re.compile(rb"^data: ?(\{.*\})[ \t\r]*$", re.M)


def server_error_status(event: Any) -> int | None:
    """The 5xx status a stream event reports, else None (not an error, or the client's)."""
    if not isinstance(event, dict):
        return None
    error = event.get("error")
    if isinstance(error, dict) and event.get("type") == "error":  # Anthropic
        return None if error.get("type") in ANTHROPIC_CLIENT_KINDS else 500
    if isinstance(error, dict):  # OpenAI
        try:
            code = int(error.get("code") or 500)
        except (TypeError, ValueError):
            code = 500
        return code if code >= 500 else None
    if event.get("type") == "error":  # the Responses API's error event
        status = event.get("code")
        return None if isinstance(status, int) and 400 <= status < 500 else 500
    return None


def scrubbed_event(event: dict[str, Any], status: int, request_id: str,
                   protocol: Protocol) -> dict[str, Any]:
    """The event that replaces a server-error event: same shape, a request id only."""
    if event.get("type") == "error" and not isinstance(event.get("error"), dict):
        return {"type": "error", "code": "internal_server_error", "param": None,
                "message": internal_message(request_id),
                "sequence_number": event.get("sequence_number")}
    return error_payload(status, internal_message(request_id), "internal_server_error",
                         protocol=protocol)


class ScrubMiddleware:
    """See the module docstring. ``retry_after_s``: the Retry-After a scrubbed 503 gets."""

    def __init__(self, app: ASGIApp, retry_after_s: int = 1):
        self.app, self.retry_after_s = app, retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = header(scope, b"x-request-id")
        if not request_id:
            request_id = str(uuid.uuid4())
            scope["headers"] = [*scope.get("headers", []),
                                (b"x-request-id", request_id.encode())]
        scrubber = _Scrubber(scope, send, request_id, self.retry_after_s)
        try:
            await self.app(scope, receive, scrubber.send)
            await scrubber.finish()
        except Exception:  # the app's own failure: logged whole, answered by request id
            logger.exception("dsv4: request %s failed behind the edge", request_id)
            await scrubber.fail()


class _Scrubber:
    """Wraps ``send``: holds a 5xx start until its body is known, then sends the
    request-id body instead; rewrites server-error events in a stream."""

    def __init__(self, scope: Scope, send: Send, request_id: str, retry_after_s: int):
        self._scope, self._send = scope, send
        self.request_id, self.retry_after_s = request_id, retry_after_s
        self.protocol = protocol_of(scope)
        self.sent = self.streaming = False  # sent: a response start went to the client
        self._held: Message | None = None
        self._held_body: list[bytes] = []

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", []))
            self.streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            if message["status"] >= 500 and not self._scope.get(PUBLIC_ERROR_KEY):
                self._held, self._held_body = message, []
                return
            self.sent = True
        elif message["type"] == "http.response.body":
            if self._held is not None:
                self._held_body.append(message.get("body", b""))
                if not message.get("more_body", False):
                    await self._send_scrubbed()
                return
            if self.streaming:
                message = {**message, "body": self._scrub_events(message.get("body", b""))}
        await self._send(message)

    async def finish(self) -> None:
        """A 5xx start sent without a last body chunk still goes out (scrubbed)."""
        if self._held is not None:
            await self._send_scrubbed()

    async def fail(self) -> None:
        """The app raised: a scrubbed 500 (or the held 5xx's status) unless a response
        already went out (then only the log has it)."""
        if self.sent:
            return
        if self._held is None:
            self._held = {"type": "http.response.start", "status": 500, "headers": []}
        await self._send_scrubbed()

    async def _send_scrubbed(self) -> None:
        held = self._held
        assert held is not None
        status = held["status"]
        body = internal_error_body(status, self.request_id, self.protocol)
        said = b"".join(self._held_body)
        if said != body:
            logger.error("dsv4: request %s answered %d: %s", self.request_id, status,
                         said[:4000].decode("utf-8", "replace"))
        headers = [(k, v) for k, v in held.get("headers", [])
                   if k.lower() not in (b"content-length", b"content-type")]
        headers += [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())]
        if not any(k.lower() == b"x-request-id" for k, _ in headers):
            headers.append((b"x-request-id", self.request_id.encode()))
        if status == 503 and not any(k.lower() == b"retry-after" for k, _ in headers):
            headers.append((b"retry-after", str(self.retry_after_s).encode()))
        self._held, self.sent = None, True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    def _scrub_events(self, chunk: bytes) -> bytes:
        if b'"error"' not in chunk:
            return chunk

        def scrub(match: re.Match[bytes]) -> bytes:
            try:
                event = json.loads(match.group(1))
            except ValueError:
                return match.group(0)
            status = server_error_status(event)
            if status is None:
                return match.group(0)
            clean = scrubbed_event(event, status, self.request_id, self.protocol)
            if event != clean:
                logger.error("dsv4: request %s stream error: %s", self.request_id,
                             match.group(1)[:4000].decode("utf-8", "replace"))
            return b"data: " + json.dumps(clean).encode()

        return _SSE_DATA.sub(scrub, chunk)
