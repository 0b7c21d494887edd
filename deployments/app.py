"""``deployments.app:build_app``: the one Serve application builder.

Usable from ``serve run``/``serve deploy``, KubeRay ``serveConfigV2`` and
``dsv4-serve run``. The application is Ray Serve LLM's OpenAI app (its ingress,
its protocol, its request handling) with three changes: the server class is
``DSv4Server``, a ``KVSpecController`` deployment watches the servers, and the
ingress also answers ``GET /v1/kv-spec`` so the verdict lives on the same HTTP
port as the API it vouches for.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import model_validator
from pydantic_core import PydanticCustomError
from ray import serve
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle
from ray.serve.llm import LLMConfig, build_dp_deployment, build_llm_deployment
from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress
from ray.serve.llm.openai_api_models import ChatCompletionRequest, ErrorResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments import edge, ray_touches
from deployments.config import AppArgs, HTTPEdge, parse_app_args
from deployments.controller import KVSpecController
from deployments.edge import EdgeMiddleware
from deployments.logs import get_logger
from deployments.public import RefreshGate, public_report
from deployments.router import with_kv_router
from deployments.server import DSv4DPServer, DSv4Server

logger = get_logger("app")

KV_SPEC_ROUTE = "/v1/kv-spec"
CONTROLLER_NAME = "KVSpecController"
INGRESS_NAME = "DSv4Ingress"  # Serve names the ingress deployment after its class
# The controller holds no client requests; a check in progress may finish.
CONTROLLER_DRAIN_S = 5.0
# The ingress outlives the servers' drain by this much, so it relays their last chunks.
INGRESS_DRAIN_MARGIN_S = 5.0


def ingress_drain_timeout_s(args: AppArgs) -> float:
    """Seconds the ingress may take to stop: the servers' drain plus a margin.

    When an application is deleted, Serve stops all its deployments at once; each
    replica waits for its own in-flight requests, up to its
    ``graceful_shutdown_timeout_s``, before it is killed. A stream in flight is
    in flight at the ingress and at a server, so the ingress must wait longer.
    """
    return args.llm.deployment_config.drain_timeout_s + INGRESS_DRAIN_MARGIN_S


# Bounds on what a 400 echoes back: pydantic repeats the offending input in every
# error, and a hostile body must not turn into a large (or unserializable) answer.
_MAX_REPORTED_ERRORS = 5
_MAX_ECHO_CHARS = 80
# pydantic-core schema markers that show up in ``loc`` for union/wrapped fields;
# they are not field names a client could act on.
_LOC_MARKERS = frozenset({"function-wrap", "function-after", "function-before",
                          "function-plain", "json-or-python", "lax-or-strict", "chain",
                          "default", "nullable", "tagged-union", "union", "str", "int",
                          "float", "bool", "bytes", "list", "tuple", "dict", "none"})


def _echo(value: Any) -> str:
    """A short, always JSON-safe description of a rejected input value.

    Ray Serve LLM 2.60 echoes the raw input: raw ``bytes`` (a non-JSON body) and
    ``NaN`` (which Python's JSON parser accepts) then fail to serialize and the
    client gets a 500 instead of the 400 it earned.
    """
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes of non-JSON body>"
    if isinstance(value, (list, tuple, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = repr(value)
    return text if len(text) <= _MAX_ECHO_CHARS else text[:_MAX_ECHO_CHARS] + "..."


def _param(loc: tuple[Any, ...]) -> str | None:
    """The client-facing field path of a pydantic ``loc`` (``"messages.0.role"``)."""
    parts = [str(p) for p in loc[1:] if not (set(str(p)) & set("[](){}")
                                              or str(p).lower() in _LOC_MARKERS)]
    return ".".join(parts) or None


def _error_param(error: dict[str, Any]) -> str | None:
    """The field an error is about: our validators name it in ``ctx``, pydantic in ``loc``."""
    if error.get("type") == "json_invalid":
        return None
    return (error.get("ctx") or {}).get("param") or _param(tuple(error.get("loc", ())))


def _describe(error: dict[str, Any], content_type: str) -> str:
    """One validation error as ``field: what was wrong (got value)``, with the fix."""
    kind, ctx = error.get("type"), error.get("ctx") or {}
    if kind == "json_invalid":
        return (f"the body is not valid JSON ({ctx.get('error', '')} at character "
                f"{error['loc'][-1]}). Fix: send one JSON object.")
    if kind == "missing" and tuple(error.get("loc", ())) == ("body",):
        return "the body is empty. Fix: send one JSON object."
    where = _error_param(error) or "body"
    if "param" in ctx:  # our own validators: the message names value and fix
        return f"{where}: {error.get('msg')}"
    text = f"{where}: {error.get('msg', 'invalid')}"
    if kind != "missing":
        text += f" (got {_echo(error.get('input'))})"
    if isinstance(error.get("input"), (bytes, bytearray)):
        text += (f". Fix: send a JSON object with Content-Type: application/json "
                 f"(got Content-Type: {content_type or 'none'})")
    return text


async def _openai_validation_error(request: Request,
                                   exc: RequestValidationError) -> JSONResponse:
    """A request the schema rejects gets 400 with an OpenAI error, never a 500.

    400 and ``invalid_request_error`` are what the OpenAI API and vLLM's own server
    (``vllm.entrypoints.serve.exception_handling``) answer for a body that fails
    validation, malformed JSON included. ``param`` names the first offending field.
    """
    errors = list(exc.errors())
    content_type = request.headers.get("content-type", "")
    lines = [_describe(e, content_type) for e in errors[:_MAX_REPORTED_ERRORS]]
    if len(errors) > _MAX_REPORTED_ERRORS:
        lines.append(f"...and {len(errors) - _MAX_REPORTED_ERRORS} more")
    param = _error_param(errors[0]) if errors else None
    error = ErrorResponse.model_validate({"error": {
        "message": "Invalid request: " + ("; ".join(lines) or "validation failed"),
        "type": "invalid_request_error", "param": param, "code": 400}})
    return JSONResponse(error.model_dump(), status_code=400)


def _ingress_fastapi_app(edge: HTTPEdge) -> FastAPI:
    """Ray Serve LLM 2.60's ingress app (``ingress.init``) rebuilt with a closed CORS policy.

    ``init()`` adds ``CORSMiddleware(allow_origins=["*"], allow_credentials=True)``:
    any web page could call the API from a visitor's browser. The same middleware
    stack in the same order (LIFO: the request-id middleware runs first), CORS only
    for ``http.cors_allow_origins``, and ``deployments.edge.EdgeMiddleware`` outermost
    so auth and the bounds run before anything reads the body.
    """
    from fastapi.middleware.cors import CORSMiddleware
    from ray.llm._internal.serve.core.ingress.middleware import (
        SetRequestIdMiddleware,
        add_exception_handling_middleware,
    )
    from ray.llm._internal.serve.observability.metrics.fast_api_metrics import (
        add_http_metrics_middleware,
        metrics_lifespan,
    )

    app = FastAPI(lifespan=metrics_lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    add_exception_handling_middleware(app)
    if edge.cors_allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(edge.cors_allow_origins),
                           allow_credentials=True, allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    add_http_metrics_middleware(app)
    app.add_middleware(SetRequestIdMiddleware)
    app.add_middleware(EdgeMiddleware)
    return app


def _openai_fastapi_app(edge: HTTPEdge | None = None) -> FastAPI:
    """The ingress FastAPI app, with client errors in OpenAI's error format.

    Two handlers replace Ray Serve LLM 2.60's (``add_exception_handler`` on the app
    ``make_fastapi_ingress`` accepts is the supported hook; the dict entry for an
    exception class is simply overwritten):

    * ``HTTPException`` (e.g. an unknown model): FastAPI's built-in handler answers
      ``{"detail": ...}``, which OpenAI clients cannot parse. We render those with
      Ray Serve LLM's own ``get_response_for_error`` so every 4xx has the
      ``{"error": {"message", "type", "code"}}`` body.
    * ``RequestValidationError``: Ray's handler (``ingress/middleware.py
      _handle_validation_error``) puts the raw input into ``param``; a non-JSON
      body (bytes) or a ``NaN`` cannot be serialized and the client got a 500.
      Ours (``_openai_validation_error``) answers 400 and never echoes raw input.
    """
    from ray.llm._internal.serve.core.ingress.middleware import get_request_id
    from ray.llm._internal.serve.utils.server_utils import get_response_for_error

    app = _ingress_fastapi_app(edge or HTTPEdge())

    async def _openai_http_error(request: Request, exc: Exception) -> JSONResponse:
        error = get_response_for_error(exc, get_request_id(request) or "")
        return JSONResponse(error.model_dump(), status_code=error.error.code,
                            headers=getattr(exc, "headers", None))

    app.add_exception_handler(StarletteHTTPException, _openai_http_error)
    app.add_exception_handler(RequestValidationError, _openai_validation_error)
    return app


class DSv4ChatCompletionRequest(ChatCompletionRequest):
    """vLLM's chat request, rejecting a non-list ``messages`` as a validation error.

    vLLM's ``ChatCompletionRequest.check_system_message_content_type`` (a
    ``mode="before"`` validator, vLLM 0.32) iterates ``data.get("messages", [])``:
    ``"messages": null`` (or a number) raises ``TypeError``, which pydantic does
    not turn into a validation error, so it escapes FastAPI's body parsing and
    Ray Serve LLM answers 500. This validator runs first (pydantic runs a
    subclass's before-validators before the parent's) and raises a pydantic error,
    which becomes an ordinary 400. Delete it once vLLM guards that loop.
    """

    @model_validator(mode="before")
    @classmethod
    def _messages_must_be_a_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and "messages" in data:
            messages = data["messages"]
            if not isinstance(messages, list):
                # ctx "param" names the field for the 400 (a model validator has no loc).
                raise PydanticCustomError(
                    "messages_not_a_list",
                    "got {got} ({kind}): expected a list of message objects. Fix: "
                    'send e.g. "messages": [{"role": "user", "content": "Hi"}]',
                    {"param": "messages", "got": _echo(messages),
                     "kind": type(messages).__name__})
        return data


# Ray Serve LLM routes a DeepSeek-V4 chat model cannot serve: not mounted (and the
# edge answers them 404 before their body is read).
UNSERVED_ENDPOINTS = ("embeddings", "transcriptions", "score", "tokenize", "detokenize")


def _openai_endpoints() -> dict[str, Any]:
    """Ray Serve LLM's own generative OpenAI routes plus ours.

    ``DEFAULT_ENDPOINTS`` is what ``build_openai_app`` mounts; it is not
    re-exported publicly in Ray 2.60 (pinned in pyproject), hence the internal import.
    """
    from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS

    served = {k: v for k, v in DEFAULT_ENDPOINTS.items() if k not in UNSERVED_ENDPOINTS}
    return {**served, "kv_spec": lambda app: app.get(KV_SPEC_ROUTE)}


def proxy_host() -> str | None:
    """The address Serve's HTTP proxies bind, asked from the Serve controller.

    None when it cannot be told; the edge then treats the bind as reachable.
    """
    try:
        from ray.serve.context import _get_global_client

        return _get_global_client().http_config.host
    except Exception as exc:  # the answer decides a refusal; an unknown host is not loopback
        logger.warning("dsv4: could not read Serve's http_options.host (%r); treating the "
                       "proxy as reachable beyond this machine", exc)
        return None


class DSv4Ingress(OpenAiIngress):
    """Ray Serve LLM's OpenAI ingress with ``GET /v1/kv-spec`` and our HTTP edge."""

    def __init__(self, llm_deployments: dict[str, DeploymentHandle],
                 model_cards: dict[str, Any], *, kv_spec_controller: DeploymentHandle,
                 http: dict[str, Any] | None = None, **kwargs: Any):
        settings = HTTPEdge.model_validate(http or {})
        # Refuses (the deployment fails with the message) before serving anything.
        edge.install(edge.EdgeGuard.start(settings, proxy_host()))
        super().__init__(llm_deployments, model_cards, **kwargs)
        self._kv_spec = kv_spec_controller
        self._refresh = RefreshGate(settings.kv_spec_refresh_interval_s)

    async def chat(self, body: DSv4ChatCompletionRequest, request: Request) -> Response:
        """Ray Serve LLM's chat endpoint, parsing the body with ``DSv4ChatCompletionRequest``.

        FastAPI takes the body model from this signature; the request itself is
        handled by ``OpenAiIngress.chat`` unchanged.
        """
        return await super().chat(body, request)

    async def kv_spec(self, refresh: bool = False) -> JSONResponse:
        """The controller's verdict; ``?refresh=true`` checks every replica now.

        200 when the replicas agree, 409 when they disagree, 503 when the check is
        incomplete, so probes and scripts can branch on the status alone.
        Concurrent refreshes share one check and refreshes are rate-limited
        (``RefreshGate``; header ``x-dsv4-refresh`` says which); the body is the
        public report (``public_report``: no pids, paths or tracebacks).
        """
        report, how = await self._refresh.report(
            refresh, lambda fresh: self._kv_spec.report.remote(refresh=fresh))
        if hasattr(report, "model_dump"):  # a typed report: its plain-JSON form
            report = report.model_dump(mode="json")
        status = {"agree": 200, "disagree": 409}.get(report["state"], 503)
        return JSONResponse(public_report(report), status_code=status,
                            headers={"x-dsv4-refresh": how})


def _model_cards(llm_config: LLMConfig) -> dict[str, Any]:
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata

    return {llm_config.model_id: to_model_metadata(llm_config.model_id, llm_config)}


# Room above http.max_in_flight for cheap requests (models, kv-spec, 401/404 answers).
INGRESS_HEADROOM = 64


def ingress_queue_options(http: HTTPEdge) -> dict[str, Any]:
    """Bounded queues in front of the edge, so overload is a 503 at every layer.

    Ray Serve LLM's ingress default is ``max_ongoing_requests`` 1e9 with an unbounded
    proxy queue. The edge refuses generation above ``http.max_in_flight`` itself
    (an OpenAI 503 body); these bounds make Serve's proxy refuse the rest (503 with
    ``Retry-After``, Ray 2.60 ``backpressure_config``) instead of queueing without end.
    """
    return {"max_ongoing_requests": 2 * http.max_in_flight + INGRESS_HEADROOM,
            "max_queued_requests": http.max_in_flight,
            "backpressure_config": {"status_code": 503, "retry_after_s": http.retry_after_s}}


def resolve_model_source(args: AppArgs) -> str | None:
    """The tiny-model alias becomes the directory ``ensure_tiny_model`` builds (logged)."""
    if not args.llm.model_loading_config.is_tiny:
        return None
    from dsv4_patch.tiny_model import ensure_tiny_model

    path = str(ensure_tiny_model())
    logger.info("dsv4: model_source %r -> %s", args.llm.model_loading_config.model_source,
                path)
    return path


def build_app(args: dict[str, Any]) -> Application:
    """Validate ``args`` (``deployments.config.AppArgs``) and build the application."""
    return build_parsed_app(parse_app_args(args))


def build_parsed_app(parsed: AppArgs) -> Application:
    """Build the application from args the loader already validated (``dsv4-serve run``)."""
    pd = "pd" in type(parsed).model_fields  # prefill/decode pools: deployments.pd_app
    ray_touches.require(pd=pd)  # the Ray internals we build on (deployments/ray_touches.py)
    if pd:
        from deployments.pd_app import build_pd_app

        return build_pd_app(parsed)  # type: ignore[arg-type]  # a PDAppArgs
    config_dict = parsed.llm_config_dict(resolve_model_source(parsed))
    # The KV-spec router keeps requests off replicas the controller drains.
    config_dict["deployment_config"] = with_kv_router(config_dict["deployment_config"])
    dp = parsed.llm.engine_kwargs.data_parallel_size > 1
    # The class that runs: on the DP path build_dp_deployment's deployment_cls wins.
    llm_config = LLMConfig(**config_dict, server_cls=DSv4DPServer if dp else DSv4Server)
    dsv4 = parsed.dsv4.model_dump(mode="json")
    if dp:
        # DP attention: Ray Serve LLM's gang-scheduled DPServer pattern, our checks on top.
        server = build_dp_deployment(llm_config, bind_kwargs={"dsv4": dsv4},
                                     deployment_cls=DSv4DPServer)
    else:
        server = build_llm_deployment(llm_config, bind_kwargs={"dsv4": dsv4})
    controller = controller_deployment(KVSpecController, parsed).bind(server=server, dsv4=dsv4)
    return bind_ingress(parsed, llm_config, server, controller)


def controller_deployment(cls: type, parsed: AppArgs) -> Any:
    """The one controller deployment (``KVSpecController``, or P/D's ``PDController``)."""
    return serve.deployment(
        cls, name=CONTROLLER_NAME, num_replicas=1,
        ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=CONTROLLER_DRAIN_S,
        graceful_shutdown_wait_loop_s=parsed.llm.deployment_config.drain_poll_s)


def bind_ingress(parsed: AppArgs, llm_config: LLMConfig, server: Application,
                 controller: Application) -> Application:
    """Our ingress in front of ``server`` (the deployment clients' requests go to)."""
    ingress_cls = make_fastapi_ingress(DSv4Ingress, endpoint_map=_openai_endpoints(),
                                       app=_openai_fastapi_app(parsed.http))
    options = DSv4Ingress.get_deployment_options([llm_config]) | {
        # The ingress relays the servers' streams: it may stop only after they have.
        "graceful_shutdown_timeout_s": ingress_drain_timeout_s(parsed),
        "graceful_shutdown_wait_loop_s": parsed.llm.deployment_config.drain_poll_s,
    } | ingress_queue_options(parsed.http)
    return serve.deployment(ingress_cls, **options).bind(
        llm_deployments={llm_config.model_id: server},
        model_cards=_model_cards(llm_config),
        kv_spec_controller=controller,
        http=parsed.http.model_dump(mode="json"),
        # As build_openai_app does: the ingress lists and routes the LoRA adapters.
        lora_paths=_lora_paths(llm_config),
    )


def _lora_paths(llm_config: LLMConfig) -> dict[str, str]:
    """Base model id -> the adapters' directory, for the ingress (empty without LoRA)."""
    lora = llm_config.lora_config
    if lora is None:
        return {}
    return {llm_config.model_id: lora.dynamic_lora_loading_path}
