"""The one-pool Serve application, and the pieces every pattern's builder shares.

The application is Ray Serve LLM's server deployment with ``DSv4Server`` replicas that
are their own HTTP ingress
(``deployments.http.front``: vLLM's OpenAI app in the replica, behind our edge, plus
``GET /v1/kv-spec``), and a ``KVSpecController`` deployment that watches them. Serve's
proxy hands each request straight to a server replica, picked by
``deployments.serving.router.KVSpecRouter``: no ingress replica in between
(``docs/benchmarks.md`` section 2 has the per-hop numbers). Its Serve options come from
``deployments.serving.server_options`` where that covers the config, so the process that
builds the app imports no vLLM; else from Ray Serve LLM's builders
(``deployments.serving.llm_build``). The P/D pattern (``deployments.pd.builder``) reuses
the shared pieces; this module never imports it.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

from ray import serve
from ray.serve.deployment import Application

from deployments.config import AppArgs, HTTPEdge
from deployments.config.app_args import apply_http_to_engine
from deployments.config.responses import ResponsesStore
from deployments.control.controller import KVSpecController
from deployments.logs import get_logger
from deployments.plan.kv_figures import plan_capacity
from deployments.serving.autoscale import with_autoscaling_policy
from deployments.serving.boot import LocalModelCallback
from deployments.serving.names import CONTROLLER_DRAIN_S, CONTROLLER_NAME
from deployments.serving.router import with_kv_router
from deployments.serving.server_options import (
    dp_size,
    server_deployment,
    server_options,
    uncovered,
)

logger = get_logger("app")

# Room above http.max_in_flight for cheap requests (models, kv-spec, 401/404 answers).
INGRESS_HEADROOM = 64


def ingress_queue_options(http: HTTPEdge, deployment_config: dict[str, Any]) -> dict[str, Any]:
    """Bounded queues in front of the edge, so overload is a 503 at every layer.

    Ray Serve LLM's server default is ``max_ongoing_requests`` 1e9 with an unbounded
    proxy queue. A value the user set in ``llm.deployment_config`` is kept. The edge
    refuses generation above its share of ``http.max_in_flight`` itself (an OpenAI 503
    body); these bounds make Serve's proxy refuse the rest (503 with
    ``Retry-After``, Ray 2.60 ``backpressure_config``) instead of queueing without end.
    """
    defaults = {"max_ongoing_requests": 2 * http.max_in_flight + INGRESS_HEADROOM,
                "max_queued_requests": http.max_in_flight,
                "backpressure_config": {"status_code": 503,
                                        "retry_after_s": http.retry_after_s}}
    return {k: v for k, v in defaults.items() if k not in deployment_config}


def resolve_model_source(args: AppArgs) -> str | None:
    """The tiny-model alias becomes the directory ``ensure_tiny_model`` builds (logged)."""
    if not args.llm.model_loading_config.is_tiny:
        return None
    from dsv4_patch.tiny_model import ensure_tiny_model

    path = str(ensure_tiny_model())
    logger.info("dsv4: model_source %r -> %s", args.llm.model_loading_config.model_source,
                path)
    return path


def build_one_pool_app(parsed: AppArgs) -> Application:
    """The one-pool application: server replicas (each its own HTTP ingress) and the
    KV-spec controller that watches them."""
    config = server_config(parsed)
    refuse_lora(config.get("lora_config"))
    server = one_pool_server(config)
    dsv4 = parsed.dsv4.model_dump(mode="json")
    # The controller finds the servers by name: they bind it (for /v1/kv-spec), and a
    # Serve graph has no cycles.
    controller = controller_deployment(KVSpecController, parsed).bind(
        server=server.name, dsv4=dsv4,
        kv_capacity=plan_capacity(parsed.llm.model_loading_config.model_id,
                                  parsed).model_dump(mode="json"))
    # Every DP rank is its own Serve replica and ingress: the share divides by ranks.
    bind_kwargs = {"dsv4": dsv4} | ingress_bind_kwargs(
        parsed.http, parsed.max_serving_replicas, controller,
        parsed.llm.deployment_config.drain_timeout_s, parsed.responses)
    return server.bind(bind_kwargs)


def server_config(parsed: AppArgs) -> dict[str, Any]:
    """The server deployment's ``LLMConfig`` dict: the user's, the edge's engine settings,
    the router or HAProxy's health check, queue bounds and the boot callback."""
    config_dict = with_http_engine_settings(
        parsed.llm_config_dict(resolve_model_source(parsed)), parsed.http)
    if parsed.http.ingress == "haproxy":
        # Ray 2.60 refuses a custom request router on an ingress deployment under HAProxy
        # (serve._private.build_app): a drained replica fails the health check HAProxy
        # polls instead (deployments.doors.dataplane).
        logger.info("dsv4: http.ingress=haproxy: HAProxy picks the replica; a drained or "
                    "engine-dead replica fails its /-/healthz and leaves HAProxy's rotation")
    else:  # the KV-spec router keeps requests off replicas the controller drains
        config_dict["deployment_config"] = with_kv_router(config_dict["deployment_config"],
                                                          parsed.dsv4.routing)
    # Autoscaling on KV usage and queue depth (dsv4.autoscaling), in whole DP gangs.
    config_dict["deployment_config"] = with_autoscaling_policy(
        config_dict["deployment_config"], parsed.dsv4.autoscaling, dp_size(config_dict))
    return serving_config(config_dict, parsed.http)


class ServerBuild(Protocol):
    """The server deployment, however it is built: its name, then its bound application."""

    @property
    def name(self) -> str: ...

    def bind(self, bind_kwargs: dict[str, Any]) -> Application: ...


class ImportPathServer:
    """The server deployment from ``server_options``: the replica gets the ``LLMConfig``
    dict and the class by import path, so this process imports no vLLM."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.options = server_options(config)
        self.name: str = self.options["name"]

    def bind(self, bind_kwargs: dict[str, Any]) -> Application:
        return server_deployment(self.options, dp_size(self.config) > 1).bind(
            llm_config=self.config, **bind_kwargs)


def one_pool_server(config: dict[str, Any]) -> ServerBuild:
    """How the server deployment is built: ``ImportPathServer`` where ``server_options``
    covers the config, else Ray Serve LLM's builders (logged, with the reason)."""
    reason = uncovered(config)
    if reason is None:
        server = ImportPathServer(config)
        logger.info("dsv4: %s built by import path (deployments.serving.server_options): "
                    "only its replicas import vLLM", server.name)
        return server
    logger.info("dsv4: the server deployment is built by Ray Serve LLM's builder (%s): "
                "this process imports vLLM", reason)
    from deployments.serving.llm_build import RayServeLLMServer

    return RayServeLLMServer(config)


def with_http_engine_settings(config_dict: dict[str, Any], http: HTTPEdge) -> dict[str, Any]:
    """``config_dict`` with what the edge's settings decide inside the engine
    (``apply_http_to_engine``), each value set logged: never a silent change."""
    config_dict = copy.deepcopy(config_dict)
    for line in apply_http_to_engine(config_dict, http):
        logger.info("dsv4: %s", line)
    return config_dict


def serving_config(config_dict: dict[str, Any], http: HTTPEdge) -> dict[str, Any]:
    """``config_dict`` for the deployment that answers HTTP: queue bounds, boot callback.

    The queue bounds make overload a 503 at Serve's proxy as well as at the edge.
    """
    deployment_config = config_dict["deployment_config"]
    config_dict = config_dict | {
        "deployment_config": deployment_config | ingress_queue_options(http, deployment_config)}
    return with_boot_callback(config_dict)


def with_boot_callback(config_dict: dict[str, Any]) -> dict[str, Any]:
    """Skips the per-node download task for a local model directory (boot time);
    a ``callback_config`` the user set is kept."""
    if "callback_config" in config_dict:
        return config_dict
    return config_dict | {"callback_config": {"callback_class": LocalModelCallback}}


def ingress_bind_kwargs(http: HTTPEdge, serving_replicas: int,
                        controller: Application, drain_timeout_s: float,
                        responses: ResponsesStore) -> dict[str, Any]:
    """What a server replica that is the HTTP ingress is bound with (``DSv4ServerMixin``):
    the edge settings, how many Serve replicas (DP ranks, not gangs or nodes) share
    ``http.max_in_flight`` at most, the controller, and how long requests held on the
    replica's own port (``http.replica_port``) may take to finish at shutdown, and
    where Responses state lives (``args.responses``, used with ``http.responses_store``)."""
    return {"http": http.model_dump(mode="json"), "serving_replicas": serving_replicas,
            "kv_spec_controller": controller, "drain_timeout_s": drain_timeout_s,
            "responses": responses.model_dump(mode="json")}


def controller_deployment(cls: type, parsed: AppArgs) -> Any:
    """The one controller deployment (``KVSpecController``, or P/D's ``PDController``)."""
    return serve.deployment(
        cls, name=CONTROLLER_NAME, num_replicas=1,
        ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=CONTROLLER_DRAIN_S,
        graceful_shutdown_wait_loop_s=parsed.llm.deployment_config.drain_poll_s)


def refuse_lora(lora_config: object) -> None:
    """LoRA adapters are refused, not ignored: nothing routes them on this path yet.

    Ray Serve LLM's ingress turned ``model: base:adapter`` into a multiplexed model id;
    the server replicas now answer HTTP themselves (``deployments.http.front``) and Serve's
    proxy sets that id only from the ``serve_multiplexed_model_id`` header.
    """
    if lora_config is not None:
        raise ValueError(
            "llm.lora_config is set, but the DSv4 server replicas serve vLLM's OpenAI app "
            "directly and route no LoRA adapters yet. Fix: remove lora_config.")
