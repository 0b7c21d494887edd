"""The server replica as its own HTTP ingress: vLLM's OpenAI app behind our edge.

Why (issue 16, measured in ``docs/benchmarks.md`` section 2): with Ray Serve LLM's
``OpenAiIngress`` every request crossed three Python processes before the engine --
Serve's proxy, the ingress replica (parses the body into pydantic, calls the server
through a ``DeploymentHandle``, re-serializes every streamed chunk) and the server
replica. On 2 cores that doubled TTFT over plain ``vllm serve``. Here the server
replica is the Serve ingress (``serve.ingress()`` with the late-bound
``__serve_build_asgi_app__`` hook, the mechanism Ray Serve LLM's own direct
streaming uses): Serve's proxy hands the HTTP request to the replica that runs the
engine, and vLLM's own OpenAI app answers it in-process, as under ``vllm serve``.

What the removed hop gave us is kept by hardening that app (``harden``) the same way
the ingress app was hardened, so the OpenAI API, errors, streaming and usage are
vLLM's own, and on top of them:

* the edge (``deployments.http.edge.edge_stack``) outermost: 5xx scrubbing, API keys,
  404/405 for unserved routes (vLLM's app also mounts ``/metrics``, ``/tokenize``,
  ``/health``...: they stay closed), in-flight slots, body/size/nesting/field bounds,
  stream limits;
* our CORS policy instead of vLLM's (``allowed_origins=["*"]`` by default);
* our ``RequestValidationError`` handler (400 naming the field, never echoing raw input)
  and ``HTTPException`` handler (OpenAI error bodies, never ``{"detail": ...}``);
* ``GET /v1/kv-spec``, answered from the KV-spec controller through a handle, with
  the answering replica's API key file status (``ingress_state``);
* ``GET /v1/models*`` model cards whose ``root`` is the served model id, never the
  model's filesystem path (``PublicModelCards``).

Routing stays Serve's: the proxy picks a server replica with the deployment's
``request_router_config`` (``deployments.serving.router.KVSpecRouter``), so drained replicas
get no requests. Drain on shutdown stays Serve's graceful shutdown of the replica
that holds the stream.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments import serve_env
from deployments.config import HTTPEdge
from deployments.http.auth import KeyStore
from deployments.http.edge import Edge, Layer, edge_stack, in_flight_share, place
from deployments.http.errors import openai_http_error, openai_validation_error
from deployments.http.key_metrics import key_file_metrics
from deployments.http.public import public_report
from deployments.http.refusal import (
    Refusal,
    mark_public_error,
    refuse,
)
from deployments.http.routes import KV_SPEC_ROUTE
from deployments.logs import get_logger

logger = get_logger("front")



# (report, how) for ``GET /v1/kv-spec``: ``deployments.http.public.RefreshGate.report``.
KVSpecSource = Callable[[bool], Awaitable[tuple[Any, str]]]


def proxy_host() -> str | None:
    """The address Serve's HTTP proxies bind, asked from the Serve controller.

    None when it cannot be told, or when Serve's direct ingress makes this replica
    listen on a port of its own (``deployments.serve_env``): the edge then treats the
    bind as reachable.
    """
    if serve_env.replicas_listen():
        logger.warning("dsv4: Serve's direct ingress is on: this replica listens on its own "
                       "port beside the proxy; treated as reachable beyond this machine")
        return None
    try:
        from ray.serve.context import _get_global_client

        return _get_global_client().http_config.host
    except Exception as exc:  # the answer decides a refusal; an unknown host is not loopback
        logger.warning("dsv4: could not read Serve's http_options.host (%r); treating the "
                       "proxy as reachable beyond this machine", exc)
        return None


def _close_cors(app: FastAPI, settings: HTTPEdge) -> list[Layer]:
    """Drop every CORS middleware the app came with; ours (its layer) only if configured.

    vLLM's ``build_app`` adds ``CORSMiddleware(allow_origins=args.allowed_origins)``,
    ``["*"]`` unless told otherwise: any web page could call the API from a
    visitor's browser.
    """
    app.user_middleware = [m for m in app.user_middleware if m.cls is not CORSMiddleware]
    if not settings.cors_allow_origins:
        return []
    return [(CORSMiddleware, {"allow_origins": list(settings.cors_allow_origins),
                              "allow_credentials": True, "allow_methods": ["GET", "POST"],
                              "allow_headers": ["authorization", "content-type"]})]


def ingress_state(keys: KeyStore | None) -> dict[str, Any]:
    """What the answering replica's edge says about itself, for ``dsv4-serve status``:
    its API key file's status without path or error text (``KeyFileStatus.public``);
    ``stale`` = a bad edit is refused and the last good keys still serve."""
    status = keys.file_status() if keys is not None else None
    return {"api_key_file": status.public() if status is not None else None}


def kv_spec_response(report: Any, how: str, keys: KeyStore | None = None) -> JSONResponse:
    """200 agree, 409 disagree, 503 otherwise; the public (redacted) report as the body.

    The route marks its 503 public (``problem.mark_public_error``): the body is the
    redacted report, which the edge's 5xx scrubbing must let through.
    """
    if hasattr(report, "model_dump"):  # a typed report: its plain-JSON form
        report = report.model_dump(mode="json")
    status = {"agree": 200, "disagree": 409}.get(report["state"], 503)
    body = public_report(report) | {"ingress": ingress_state(keys)}
    return JSONResponse(body, status_code=status, headers={"x-dsv4-refresh": how})


_MODELS_ROUTE = re.compile(r"^/v1/models(/.+)?/?$")


class PublicModelCards:
    """``GET /v1/models`` and ``/v1/models/{id}`` with ``root`` = the card's id.

    vLLM 0.32's model list puts ``BaseModelPath.model_path`` in ``root``: under
    Ray Serve LLM that is ``model_source``, a filesystem path on the replica's node
    (or a Hub id). A client needs the id it sends as ``model``; where the weights
    lie is nobody's business but the operator's. Rewrites only successful JSON
    answers; anything else passes unchanged.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") != "GET"
                or not _MODELS_ROUTE.match(scope.get("path", ""))):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def hold(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                await _send_cards(send, start, b"".join(chunks))

        await self.app(scope, receive, hold)


def public_cards(body: Any) -> Any:
    """A model list or card with every ``root`` set to its card's id."""
    cards = body.get("data") if isinstance(body, dict) and body.get("object") == "list" \
        else [body]
    for card in cards if isinstance(cards, list) else []:
        if isinstance(card, dict) and "root" in card:
            card["root"] = card.get("id")
    return body


async def _send_cards(send: Send, start: Message, raw: bytes) -> None:
    if start["status"] == 200:
        try:
            raw = json.dumps(public_cards(json.loads(raw))).encode()
        except ValueError:
            pass  # not JSON: nothing of ours to rewrite, it goes out as the app wrote it
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(raw)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": raw, "more_body": False})


def background_tasks(app: FastAPI) -> Callable[[str], Any]:
    """Response id -> vLLM's background task for it (``OpenAIServingResponses.
    background_tasks``, vLLM 0.32-0.34), read when a request ends (state is set late)."""
    def task(response_id: str) -> Any:
        serving = getattr(app.state, "openai_serving_responses", None)
        tasks = getattr(serving, "background_tasks", None)
        return tasks.get(response_id) if isinstance(tasks, dict) else None

    return task


async def closed_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The HTTP app of a replica built without an edge: every request gets a 503."""
    if scope["type"] == "http":
        await refuse(scope, send, Refusal(503, "this replica does not answer HTTP (it has "
                                          "no edge). Fix: call the application's route.",
                                          "unavailable", "routes"))


def harden(app: FastAPI, edge: Edge, kv_spec: KVSpecSource | None = None) -> FastAPI:
    """``app`` (vLLM's OpenAI app, or a stand-in in tests) with our edge, CORS and handlers.

    Works on an app whose middleware stack is already built (vLLM's ``build_app``
    builds it): the cached stack is dropped so Starlette rebuilds it, with the edge
    (``edge_stack``) outermost, on the first request.
    """
    settings = edge.settings
    app.middleware_stack = None
    cors = _close_cors(app, settings)
    # Starlette types handlers for Exception; FastAPI dispatches by the class given.
    app.add_exception_handler(RequestValidationError, openai_validation_error)  # type: ignore[arg-type]  # Starlette types handlers for Exception; FastAPI dispatches by class
    # Starlette's (body parsing: "There was an error parsing the body") and FastAPI's
    # (vLLM registers its own for that one; ours names the fix and the error type).
    app.add_exception_handler(StarletteHTTPException, openai_http_error)
    app.add_exception_handler(HTTPException, openai_http_error)
    if kv_spec is not None:
        async def kv_spec_route(request: Request, refresh: bool = False) -> JSONResponse:
            """The controller's verdict; ``?refresh=true`` checks every replica now."""
            response = kv_spec_response(*await kv_spec(refresh), edge.keys)
            if response.status_code >= 500:
                mark_public_error(request.scope)  # the redacted report, not an error text
            return response

        app.add_api_route(KV_SPEC_ROUTE, kv_spec_route, methods=["GET"])
    place(app, edge_stack(edge, background_tasks(app), [(PublicModelCards, {}), *cors]))
    return app


def start_edge(settings: HTTPEdge, serving_replicas: int) -> Edge:
    """This replica's edge, with its share of ``http.max_in_flight`` in its settings.

    Refuses (the deployment fails with the message) before the engine boots.
    """
    settings, note = in_flight_share(settings, serving_replicas)
    if note:
        logger.info("dsv4: this replica admits %d generation requests at once "
                    "(http.max_in_flight%s)", settings.max_in_flight, note)
    replica_edge = Edge.start(settings, proxy_host(), limit_note=note)
    if replica_edge.keys.file_configured:
        replica_edge.keys.watch(key_file_metrics())
    return replica_edge
