"""The HTTP edge of a serving replica: one ASGI middleware in front of vLLM's app.

It answers, in this order and before the body is parsed by anyone:

1. **401** without a valid ``Authorization: Bearer <key>`` (``deployments.http.auth``),
   on every route, ``/health`` included;
2. **404/405** for routes this deployment does not serve (``deployments.http.routes``:
   a closed route's 404 says why it is closed), before the body is read;
3. **503 + Retry-After** when this replica already holds its share of
   ``http.max_in_flight`` requests (``in_flight_share``): checked before the body is
   read and again before the slot is taken, which is only once the body is here;
4. **408** when the body does not arrive within ``http.body_timeout_s``; **413** above
   ``http.max_body_bytes`` (Content-Length or counted);
5. **400** naming the field for: a body that is not UTF-8; JSON nested deeper than
   ``http.max_json_depth`` (counted in one linear pass); ``kv_transfer_params`` or
   ``ec_transfer_params`` from a client; any of the route's bounded fields above its
   limit, read as vLLM's models read them (``"256"`` and ``256.0`` are 256); too many
   prompts; a chat ``messages`` that is not a list; Responses that need the response
   store while ``http.responses_store`` is off.

An absent token limit is bounded too, by the engine: the builder sets vLLM's
``override_generation_config.max_new_tokens`` to ``http.max_tokens``.

While the request runs it bounds streams (``stream_max_s`` overall,
``stream_idle_s`` between chunks; the stream then ends with an error event and
``[DONE]``, and the cancellation reaches the engine, which aborts the request).

On every route (``_Scrubber`` wraps ``send`` once, in ``EdgeMiddleware.__call__``)
it rewrites every 5xx body the app sends, and 5xx error events inside a stream, to
carry only a request id, and answers an exception that escapes the app with such
a 500: the text (Ray's errors name pids and IPs, vLLM's catch-all handler returns
``str(exc)``) goes to the log, not to the client. Only the edge's own answers
(401, 404, overload 503...) go out as written.

An ``OPTIONS`` request skips the key check only when it is a real CORS preflight
(``Origin`` and ``Access-Control-Request-Method``) and CORS is configured; the CORS
middleware behind answers it without reaching a route. WebSocket connections are
refused (no served route is a WebSocket); lifespan events pass through.

Pure ASGI (no ``BaseHTTPMiddleware``), so client disconnects still reach the app.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from deployments.config import HTTPEdge
from deployments.http import routes
from deployments.http.auth import KeyStore, bearer_token
from deployments.http.bounds import STORE_SETTING, body_problem
from deployments.logs import get_logger

logger = get_logger("edge")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """The OpenAI error shape every answer of the edge uses."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": status}}).encode()


# ------------------------------------------------------------------ the guard


def in_flight_share(settings: HTTPEdge, replicas: int) -> tuple[HTTPEdge, str]:
    """This replica's part of the fleet-wide ``http.max_in_flight`` and how it was derived.

    Every serving replica is an ingress with its own edge (``deployments.http.front``);
    ``http.max_in_flight`` stays the bound for the whole deployment at its largest, so
    each replica admits ``ceil(max_in_flight / replicas)``. ``replicas`` counts Serve
    replicas: with DP attention every rank is one (``AppArgs.max_serving_replicas``),
    never the gangs (nodes) ``max_replicas`` counts.
    """
    if replicas <= 1:
        return settings, ""
    share = -(-settings.max_in_flight // replicas)
    note = f" {settings.max_in_flight} over at most {replicas} replicas"
    return settings.model_copy(update={"max_in_flight": share}), note


class ResponseHolderGone(Exception):
    """The replica that stores a response is no longer running (``Relay`` raises it)."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


# (holder replica id, scope, body) -> the holder's ASGI messages
# (``deployments.serving.relay.Relay.send_to``).
Relay = Callable[[str, MutableMapping[str, Any], bytes], AsyncIterator[MutableMapping[str, Any]]]


@dataclass
class EdgeGuard:
    """Per-process edge state: settings, keys, whether keys are required, in-flight count;
    with the Responses store on, this replica's id and the relay to the others."""

    settings: HTTPEdge
    keys: KeyStore
    bind_host: str | None
    in_flight: int = 0
    rejected: dict[int, int] = field(default_factory=dict)
    limit_note: str = ""  # how settings.max_in_flight was derived, for the 503 message
    replica_id: str | None = None
    relay: Relay | None = None

    @classmethod
    def start(cls, settings: HTTPEdge, bind_host: str | None,
              environ: dict[str, str] | None = None) -> EdgeGuard:
        """Build the guard; raises ``AuthConfigError`` when the auth settings cannot hold."""
        keys = KeyStore(settings.auth, environ)
        keys.check_startup(bind_host)
        if keys.required(bind_host):
            logger.info("dsv4: API keys required on every route (%s)", "; ".join(keys.sources))
        else:
            logger.warning("dsv4: API keys not required now (http.auth.mode=%s, proxy host "
                           "%r, no key configured)", settings.auth.mode, bind_host)
        return cls(settings, keys, bind_host)


_GUARD: EdgeGuard | None = None


def install(guard: EdgeGuard) -> None:
    """Make ``guard`` the one the middleware of this process uses (the ingress's __init__)."""
    global _GUARD
    _GUARD = guard


def current() -> EdgeGuard | None:
    return _GUARD


# ------------------------------------------------------------------ the middleware


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _route(scope: Scope) -> str:
    """The path inside the application (Serve passes the route prefix as root_path)."""
    path, root = scope.get("path", "/"), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path.rstrip("/") or "/"


class _ClientGone(Exception):
    """The client went away before its body arrived: nobody to answer."""


class _Rejected(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.headers = headers or []


# Serve's proxy turns this header into a multiplexed (LoRA) model id; refused with
# LoRA itself (``deployments.serving.builder.refuse_lora``).
MULTIPLEXED_HEADER = b"serve_multiplexed_model_id"


class EdgeMiddleware:
    """See the module docstring. Reads its settings from the installed ``EdgeGuard``."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await _refuse_websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _header(scope, b"x-request-id")
        if not request_id:
            request_id = str(uuid.uuid4())
            scope["headers"] = [*scope.get("headers", []),
                                (b"x-request-id", request_id.encode())]
        guard = current()
        scrubber = _Scrubber(scope, send, request_id,
                             guard.settings.retry_after_s if guard is not None else 1)
        try:
            if guard is None:
                raise _Rejected(503, "the ingress is starting; retry shortly", "unavailable",
                                headers=[(b"retry-after", b"1")])
            await self._handle(guard, scope, receive, scrubber.send, request_id)
            await scrubber.finish()
        except _ClientGone:
            return
        except _Rejected as rej:
            guard_count = guard.rejected if guard else {}
            guard_count[rej.status] = guard_count.get(rej.status, 0) + 1
            await _send_error(send, rej, request_id)
        except Exception:  # the app's own failure: logged whole, answered by request id only
            logger.exception("dsv4: request %s failed behind the edge", request_id)
            await scrubber.fail()

    async def _handle(self, guard: EdgeGuard, scope: Scope, receive: Receive, send: Send,
                      request_id: str) -> None:
        settings, path, method = guard.settings, _route(scope), scope.get("method", "GET")
        if settings.cors_allow_origins and _is_preflight(scope):
            await self.app(scope, receive, send)  # CORS preflight carries no credentials
            return
        if _key_required(guard, request_id):
            token = bearer_token(_header(scope, b"authorization"))
            if token is None or not _key_matches(guard, token, request_id):
                what = "no API key" if token is None else "an invalid API key"
                raise _Rejected(401, f"the request has {what}. Fix: send "
                                "`Authorization: Bearer <key>` with a key the server "
                                "operator gave you.", "authentication_error",
                                headers=[(b"www-authenticate", b"Bearer")])
        if _header(scope, MULTIPLEXED_HEADER):
            raise _Rejected(400, f"header {MULTIPLEXED_HEADER.decode()} asks for a LoRA "
                            "adapter (Serve model multiplexing); this deployment serves "
                            "no adapters. Fix: drop the header and name the base model in "
                            "`model`.", "invalid_request_error")
        route = _check_route(path, method)
        if route.stateful and not settings.responses_store and route is not _RESPONSES:
            raise _Rejected(404, f"response {routes.response_id(path)} was not stored: this "
                            f"server does not store responses ({STORE_SETTING} is false). "
                            "Fix: keep the response the create call returned, or ask the "
                            f"operator to enable {STORE_SETTING}.", "not_found_error")
        if not route.body:
            holder = _holder(guard, scope, routes.response_id(path))
            if holder:
                await _relay(guard, holder, scope, b"", send)
                return
            await _run_bounded(self.app, scope, receive, send, settings, request_id)
            return
        _admit(guard)  # shed load before reading anything
        raw = await _read_body(scope, receive, settings)
        _check_body(raw, settings, route)
        holder = None
        if route.stateful and settings.responses_store:
            raw, holder = _stored_response(guard, scope, route, path, raw)
        _admit(guard)  # the slot is taken only once the body is here and judged
        guard.in_flight += 1
        try:
            if holder:
                await _relay(guard, holder, scope, raw, send)
                return
            await _run_bounded(self.app, scope, _replay(raw, receive), send, settings,
                               request_id)
        finally:
            guard.in_flight -= 1


def _is_preflight(scope: Scope) -> bool:
    """A CORS preflight: ``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``.

    Only that skips the key check (a browser sends it without credentials); any
    other ``OPTIONS`` is an ordinary request, judged like one.
    """
    return (scope.get("method") == "OPTIONS" and bool(_header(scope, b"origin"))
            and bool(_header(scope, b"access-control-request-method")))


def _key_trouble(request_id: str) -> _Rejected:
    """The answer when the key check itself fails: 503, no detail (it is in the log)."""
    logger.exception("dsv4: request %s: the API key check failed", request_id)
    return _Rejected(503, f"the server cannot check API keys right now (request id "
                     f"{request_id}). Fix: retry later; the operator finds the cause in "
                     "the server log under that id.", "unavailable",
                     headers=[(b"retry-after", b"5")])


def _key_required(guard: EdgeGuard, request_id: str) -> bool:
    """``KeyStore.required``; a failure of the check answers 503, never its text."""
    try:
        return guard.keys.required(guard.bind_host)
    except Exception as exc:
        raise _key_trouble(request_id) from exc


def _key_matches(guard: EdgeGuard, token: str, request_id: str) -> bool:
    """``KeyStore.matches``; a failure of the check answers 503, never its text
    (the key file's path used to reach callers through vLLM's catch-all handler)."""
    try:
        return guard.keys.matches(token)
    except Exception as exc:
        raise _key_trouble(request_id) from exc


async def _refuse_websocket(scope: Scope, receive: Receive, send: Send) -> None:
    """Close a WebSocket before it is accepted (the server answers 403): no served
    route is a WebSocket, and none may bypass the key check."""
    message = await receive()
    logger.info("dsv4: refused a WebSocket connection to %s", _route(scope))
    if message["type"] == "websocket.connect":
        await send({"type": "websocket.close", "code": 1008,
                    "reason": "WebSocket is not served here"})


def _holder(guard: EdgeGuard, scope: Scope, response_id: str | None) -> str | None:
    """The other replica that stores ``response_id``, if the request must go there."""
    if not response_id or not guard.settings.responses_store or guard.relay is None:
        return None
    holder = routes.holder_of(response_id)
    if holder is None or holder == guard.replica_id:
        return None
    if any(k == routes.RELAYED_HEADER for k, _ in scope.get("headers", [])):
        # The replica that relayed it named us; we are not the holder either.
        raise _Rejected(404, f"response {response_id} is not stored on this fleet.",
                        "not_found_error")
    return holder


def _stored_response(guard: EdgeGuard, scope: Scope, route: routes.Route, path: str,
                     raw: bytes) -> tuple[bytes, str | None]:
    """With the store on: the holder a follow-up must reach, and for a new response the
    body with a ``request_id`` naming this replica (vLLM makes it the response id)."""
    if route is not _RESPONSES:  # cancel: the id is in the path
        return raw, _holder(guard, scope, routes.response_id(path))
    body = json.loads(raw)
    if not isinstance(body, dict):
        return raw, None
    if "request_id" in body:
        raise _Rejected(400, "request_id is assigned by this server while it stores "
                        f"responses ({STORE_SETTING}): the id names the replica that keeps "
                        "the response. Fix: remove request_id.", "invalid_request_error",
                        param="request_id")
    previous = body.get("previous_response_id")
    holder = _holder(guard, scope, previous) if isinstance(previous, str) else None
    if holder is None and guard.replica_id is not None:
        body["request_id"] = routes.tagged_response_id(guard.replica_id)
        raw = json.dumps(body).encode()
    return raw, holder


async def _relay(guard: EdgeGuard, holder: str, scope: Scope, raw: bytes,
                 send: Send) -> None:
    """Stream the holder's answer to this request; a lost holder is a 404 naming it."""
    assert guard.relay is not None
    try:
        async for message in guard.relay(holder, scope, raw):
            await send(message)
    except ResponseHolderGone as gone:
        raise _Rejected(404, f"the response is stored on replica {gone.holder}, which is no "
                        "longer running (replaced or scaled down): stored responses live "
                        "and end with their replica. Fix: start a new response with the "
                        "whole conversation as input.", "not_found_error") from None


_RESPONSES = routes.EXACT[routes.RESPONSES_ROUTE]


def _admit(guard: EdgeGuard) -> None:
    """503 + Retry-After when this replica holds its share of ``http.max_in_flight``."""
    settings = guard.settings
    if guard.in_flight >= settings.max_in_flight:
        raise _Rejected(503, f"the server is at its limit of {settings.max_in_flight} "
                        f"requests in flight (http.max_in_flight{guard.limit_note}). "
                        f"Fix: retry after {settings.retry_after_s} s.", "overloaded",
                        headers=[(b"retry-after", str(settings.retry_after_s).encode())])


def _check_route(path: str, method: str) -> routes.Route:
    """The served route, or 404 (with the reason for a closed one) / 405."""
    route = routes.find(path)
    if route is None:
        why = routes.CLOSED.get(path)
        text = f"is closed on this server: {why}" if why else "does not exist"
        raise _Rejected(404, f"route {path} {text}. Served routes: "
                        f"{', '.join(routes.SERVED)}.", "not_found_error")
    if method != route.method:
        raise _Rejected(405, f"{method} {path}: this route takes {route.method}.",
                        "invalid_request_error", headers=[(b"allow", route.method.encode())])
    return route


async def _read_body(scope: Scope, receive: Receive, settings: HTTPEdge) -> bytes:
    """The whole body within ``http.body_timeout_s``, refusing (413) as soon as it is known
    to exceed ``http.max_body_bytes``. Serve's proxy may hand the body on in pieces as the
    client trickles it: without the deadline a slow upload holds its connection forever."""
    limit = settings.max_body_bytes
    declared = _header(scope, b"content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    try:
        return await asyncio.wait_for(_receive_all(receive, limit), settings.body_timeout_s)
    except asyncio.TimeoutError:
        raise _Rejected(408, f"the request body did not arrive within "
                        f"{settings.body_timeout_s:g} s (http.body_timeout_s). Fix: send "
                        "the body at once.", "timeout_error") from None


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


def _too_large(size: int, limit: int) -> _Rejected:
    return _Rejected(413, f"the body has at least {size} bytes, above this server's limit "
                     f"http.max_body_bytes={limit}. Fix: send a smaller request.",
                     "invalid_request_error")


def _check_body(raw: bytes, settings: HTTPEdge, route: routes.Route) -> None:
    problem = body_problem(raw, settings, route)
    if problem:
        raise _Rejected(400, problem[1], "invalid_request_error", param=problem[0])


def _replay(raw: bytes, receive: Receive) -> Receive:
    """A receive that yields the buffered body once, then the client's own messages
    (so ``http.disconnect`` still reaches the app and cancels the generation)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay


async def _send_error(send: Send, rej: _Rejected, request_id: str) -> None:
    await _send_json(send, rej.status, error_body(rej.status, rej.message, rej.kind, rej.param),
                     request_id, rej.headers)


async def _send_json(send: Send, status: int, body: bytes, request_id: str,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()),
               (b"x-request-id", request_id.encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def internal_error_body(status: int, request_id: str) -> bytes:
    return error_body(status, f"internal server error (request id {request_id}); the "
                      "details are in the server log under that id.", "internal_server_error")


# A key our own routes set in the ASGI scope when their 5xx body is public as written
# (``deployments.http.front``: the 503 of ``/v1/kv-spec`` is the redacted report).
# Server-side only: no client can set it, vLLM and Ray never do; a middleware that
# copies the scope loses it, and the answer is then scrubbed (the safe side).
PUBLIC_ERROR_KEY = "dsv4.public_error"


def mark_public_error(scope: Scope) -> None:
    """Let this request's 5xx body out as written (it names nothing internal)."""
    scope[PUBLIC_ERROR_KEY] = True


_SSE_ERROR = re.compile(rb'^data: (\{"error".*\})\s*$', re.M)


class _Scrubber:
    """Wraps ``send`` for every route: 5xx bodies and 5xx stream error events leave
    with only a request id; what they said goes to the log.

    Idempotent: a body that already is ``internal_error_body`` passes unlogged, so
    the edge's own 500s (``_run_bounded``) can go through it too.
    """

    def __init__(self, scope: Scope, send: Send, request_id: str, retry_after_s: int = 1):
        self._scope, self._send = scope, send
        self.request_id, self.retry_after_s = request_id, retry_after_s
        self.sent = self.streaming = False  # sent: a response start went to the client
        self._held: Message | None = None  # the start of a 5xx answer, sent with a new body
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
        """The app returned: a 5xx start it sent without a last body chunk still goes
        out (scrubbed), so the client is never left without an answer."""
        if self._held is not None:
            await self._send_scrubbed()

    async def fail(self) -> None:
        """The app raised: finish the answer with a scrubbed 500 (or the held 5xx's
        status) unless a response already went out (then only the log has it)."""
        if self.sent:
            return
        if self._held is None:
            self._held = {"type": "http.response.start", "status": 500, "headers": []}
        await self._send_scrubbed()

    async def _send_scrubbed(self) -> None:
        held = self._held
        assert held is not None
        status = held["status"]
        body = internal_error_body(status, self.request_id)
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
            # e.g. no replica available while Serve replaces one: a retry will do
            headers.append((b"retry-after", str(self.retry_after_s).encode()))
        self._held, self.sent = None, True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    def _scrub_events(self, chunk: bytes) -> bytes:
        """Error events with a 5xx code inside a 200 stream get the request-id message."""
        if b'"error"' not in chunk:
            return chunk

        def scrub(match: re.Match[bytes]) -> bytes:
            try:
                code = int(json.loads(match.group(1))["error"].get("code") or 500)
            except (ValueError, TypeError, KeyError, AttributeError):
                return match.group(0)
            if code < 500:
                return match.group(0)
            scrubbed = internal_error_body(code, self.request_id)
            if match.group(1) != scrubbed:
                logger.error("dsv4: request %s stream error: %s", self.request_id,
                             match.group(1)[:4000].decode("utf-8", "replace"))
            return b"data: " + scrubbed

        return _SSE_ERROR.sub(scrub, chunk)


class _Response:
    """Watches what the app sends, for the stream limits: started, streaming, finished,
    when the last chunk went. (5xx scrubbing is ``_Scrubber``'s, on every route.)"""

    def __init__(self, send: Send, request_id: str, retry_after_s: int = 1):
        self._send, self.request_id, self.retry_after_s = send, request_id, retry_after_s
        self.started = self.finished = self.streaming = False
        self.last_chunk = time.monotonic()

    async def send(self, message: Message) -> None:
        self.last_chunk = time.monotonic()
        if message["type"] == "http.response.start":
            self.started = True
            headers = dict(message.get("headers", []))
            self.streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            self.finished = not message.get("more_body", False)
        await self._send(message)


async def _run_bounded(app: ASGIApp, scope: Scope, receive: Receive, send: Send,
                       settings: HTTPEdge, request_id: str) -> None:
    """Run the app under the stream limits; a 5xx body never leaves with internals in it."""
    response = _Response(send, request_id, settings.retry_after_s)
    task = asyncio.ensure_future(app(scope, receive, response.send))
    started = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            deadline = started + settings.stream_max_s
            if response.streaming:
                deadline = min(deadline, response.last_chunk + settings.stream_idle_s)
            # Wake at least every idle period: a stream may start while we wait.
            wait_s = min(max(0.0, deadline - now), settings.stream_idle_s)
            done, _ = await asyncio.wait({task}, timeout=wait_s)
            if done:
                break
            if time.monotonic() >= deadline:
                await _stop(task, response, settings, started)
                return
        task.result()
    except asyncio.CancelledError:
        task.cancel()
        raise
    except Exception:
        logger.exception("dsv4: request %s failed in the ingress", request_id)
        if not response.started:
            await _send_json(send, 500, internal_error_body(500, request_id), request_id)


async def _stop(task: asyncio.Future[None], response: _Response, settings: HTTPEdge,
                started: float) -> None:
    """A stream over its limits: cancel it (the engine aborts) and tell the client why."""
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled() and task.exception() is not None:
        logger.error("dsv4: request %s failed while being stopped: %r", response.request_id,
                     task.exception())
    took = time.monotonic() - started
    idle = took < settings.stream_max_s
    limit = (f"no chunk for {settings.stream_idle_s:g} s (http.stream_idle_s)" if idle
             else f"it ran {took:.0f} s, the limit http.stream_max_s is "
             f"{settings.stream_max_s:g} s")
    message = f"the request was stopped: {limit}. Fix: ask for fewer tokens."
    logger.warning("dsv4: request %s stopped: %s", response.request_id, limit)
    if not response.started:
        await _send_error(response._send, _Rejected(408, message, "timeout_error"),
                          response.request_id)
        return
    if response.finished:
        return
    event = b"data: " + error_body(408, message, "timeout_error") + b"\n\ndata: [DONE]\n\n"
    await response._send({"type": "http.response.body", "body": event, "more_body": False})
