"""The HTTP edge of the ingress: one ASGI middleware in front of Ray Serve LLM's app.

It answers, in this order and before the body is parsed by anyone:

1. **401** without a valid ``Authorization: Bearer <key>`` (``deployments.http.auth``);
2. **404/405** for routes this deployment does not serve (embeddings, score,
   transcriptions, tokenize, FastAPI's docs...), before the body is read, so a
   large multipart upload is never spooled;
3. **503 + Retry-After** when this serving replica already holds its share of
   ``http.max_in_flight`` generation requests (``in_flight_share``) (a bounded queue: overload is
   refused quickly instead of growing without limit);
4. **413** for a body above ``http.max_body_bytes`` (Content-Length or counted);
5. **400** naming the limit for JSON nested deeper than ``http.max_json_depth``
   (600 levels made Ray's pickling fail with a 500), ``n`` above ``http.max_n``,
   more prompts than ``http.max_prompts``, ``max_tokens`` above ``http.max_tokens``;
   and for a chat ``messages`` that is not a list (``deployments.http.errors.messages_problem``).

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
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from deployments.config import HTTPEdge
from deployments.http.auth import KeyStore, bearer_token
from deployments.http.errors import messages_problem
from deployments.logs import get_logger

logger = get_logger("edge")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GENERATE_ROUTES = {"/v1/completions": "POST", "/v1/chat/completions": "POST"}
KV_SPEC_ROUTE = "/v1/kv-spec"  # served by front; owned here, the lowest module using it
READ_ROUTES = {"/v1/models": "GET", KV_SPEC_ROUTE: "GET"}
MODEL_ROUTE = re.compile(r"^/v1/models/.+$")
# OpenAI/vLLM routes a DeepSeek-V4 chat deployment does not serve: named in the 404.
NOT_SERVED = ("/v1/embeddings", "/v1/score", "/v1/rerank", "/v1/audio/transcriptions",
              "/v1/audio/translations", "/tokenize", "/detokenize", "/pooling",
              "/classify")
SERVED = sorted([*GENERATE_ROUTES, *READ_ROUTES, "/v1/models/{model}"])


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """The OpenAI error shape every answer of the edge uses."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": status}}).encode()


# ------------------------------------------------------------------ body checks

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_depth(raw: bytes) -> int:
    """Nesting depth of a JSON text, without parsing it (strings skipped).

    Linear, iterative and bounded by the body size, so it is safe to run on a
    hostile body before ``json.loads``/pydantic/pickle, which all recurse.
    """
    skeleton = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(_STEP[b] for b in skeleton), default=0)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _prompt_count(prompt: Any) -> int:
    """Prompts in a completion request: a list of strings or of token-id lists is a batch."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def limit_problem(body: Any, limits: HTTPEdge) -> tuple[str, str] | None:
    """(param, message) for the first bound a parsed body exceeds, else None.

    Only well-typed values are judged here; a wrongly typed field is left to the
    request schema, whose 400 says what type was expected.
    """
    if not isinstance(body, dict):
        return None
    n = _int(body.get("n"))
    if n is not None and n > limits.max_n:
        return "n", (f"n={n} is above this server's limit http.max_n={limits.max_n}. "
                     f"Fix: ask for at most {limits.max_n} choices per request.")
    prompts = _prompt_count(body.get("prompt"))
    if prompts > limits.max_prompts:
        return "prompt", (f"prompt holds {prompts} prompts, above this server's limit "
                          f"http.max_prompts={limits.max_prompts}. Fix: split the batch.")
    for name in ("max_tokens", "max_completion_tokens"):
        value = _int(body.get(name))
        if value is not None and value > limits.max_tokens:
            return name, (f"{name}={value} is above this server's limit http.max_tokens="
                          f"{limits.max_tokens}. Fix: ask for at most {limits.max_tokens}.")
    return None


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


@dataclass
class EdgeGuard:
    """Per-process edge state: settings, keys, whether keys are required, in-flight count."""

    settings: HTTPEdge
    keys: KeyStore
    bind_host: str | None
    in_flight: int = 0
    rejected: dict[int, int] = field(default_factory=dict)
    limit_note: str = ""  # how settings.max_in_flight was derived, for the 503 message

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
        settings, route, method = guard.settings, _route(scope), scope.get("method", "GET")
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
        _check_route(route, method)
        if route not in GENERATE_ROUTES:
            await self.app(scope, receive, send)
            return
        if guard.in_flight >= settings.max_in_flight:
            raise _Rejected(503, f"the server is at its limit of {settings.max_in_flight} "
                            f"requests in flight (http.max_in_flight{guard.limit_note}). "
                            "Fix: retry after "
                            f"{settings.retry_after_s} s.", "overloaded",
                            headers=[(b"retry-after", str(settings.retry_after_s).encode())])
        guard.in_flight += 1
        try:
            raw = await _read_body(scope, receive, settings.max_body_bytes)
            _check_body(raw, settings, route)
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


def _check_route(route: str, method: str) -> None:
    expected = GENERATE_ROUTES.get(route) or READ_ROUTES.get(route) or (
        "GET" if MODEL_ROUTE.match(route) else None)
    if expected is None:
        why = ("is not served by this deployment (a DeepSeek-V4 chat/completions model)"
               if route in NOT_SERVED else "does not exist")
        raise _Rejected(404, f"route {route} {why}. Served routes: {', '.join(SERVED)}.",
                        "not_found_error")
    if method != expected:
        raise _Rejected(405, f"{method} {route}: this route takes {expected}.",
                        "invalid_request_error", headers=[(b"allow", expected.encode())])


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body, refusing (413) as soon as it is known to exceed ``limit``."""
    declared = _header(scope, b"content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
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


CHAT_ROUTE = "/v1/chat/completions"


def _check_body(raw: bytes, settings: HTTPEdge, route: str) -> None:
    depth = json_depth(raw)
    if depth > settings.max_json_depth:
        raise _Rejected(400, f"the body nests {depth} levels deep, above this server's "
                        f"limit http.max_json_depth={settings.max_json_depth}. Fix: "
                        "flatten the request.", "invalid_request_error")
    try:
        body = json.loads(raw)
    except ValueError:
        return  # the request schema answers 400 with the position of the error
    problem = limit_problem(body, settings)
    if problem:
        raise _Rejected(400, problem[1], "invalid_request_error", param=problem[0])
    bad_messages = messages_problem(body) if route == CHAT_ROUTE else None
    if bad_messages:
        raise _Rejected(400, "Invalid request: " + bad_messages, "invalid_request_error",
                        param="messages")


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
