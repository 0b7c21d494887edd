"""The P/D application: decode pool (the HTTP ingress) -> prefill pool, plus one controller.

Ray Serve LLM 2.60's P/D pattern (``serving_patterns/prefill_decode/builder.py``,
``build_pd_openai_app``): each decode replica calls the prefill deployment through a
handle. As in Ray's direct-streaming variant of that builder, the decode replica is
the Serve ingress itself (``serve.ingress()``; no ingress replica in between, issue
16): vLLM's OpenAI app in the replica, whose chat/completions routes Ray's
``PDOrchestratorMixin.__serve_build_asgi_app__`` re-points at the replica's
prefill-first ``chat``/``completions`` (``deployments.pd.server``), hardened by our
edge (``deployments.http.front``). We build the graph from Ray's blocks --
``PDServingArgs`` validates the two ``LLMConfig``s and applies its defaults (the
decode pool's NIXL side-channel port base moves off prefill's),
``build_llm_deployment`` builds each pool with the ``Prefill:``/``Decode:`` name
prefixes -- because three things differ: our servers in both pools, our edge and
``/v1/kv-spec`` on the decode replicas, and ``PDController`` watching both pools (it
finds the decode pool by name: the decode replicas bind it, a Serve graph has no
cycles). The prefill deployment routes with ``deployments.pd.route.PDPrefillRouter``
(only proven-compatible replicas), the decode deployment with ``KVSpecRouter`` (drain).
"""

from __future__ import annotations

from typing import Any

from ray.serve.deployment import Application
from ray.serve.llm import LLMConfig, build_llm_deployment

from deployments.config.pd import PDAppArgs
from deployments.doors.lifecycle import listening_ingress
from deployments.logs import get_logger
from deployments.pd import route
from deployments.pd.controller import PDController
from deployments.pd.server import DSv4PDDecodeServer, DSv4PDPrefillServer
from deployments.plan.kv_figures import plan_pool_capacities
from deployments.serving.autoscale import with_autoscaling_policy
from deployments.serving.builder import (
    controller_deployment,
    ingress_bind_kwargs,
    refuse_lora,
    resolve_model_source,
    serving_config,
    with_boot_callback,
    with_http_engine_settings,
)
from deployments.serving.llm_build import server_deployment_name
from deployments.serving.names import DECODE_PREFIX
from deployments.serving.router import with_kv_router

logger = get_logger("pd")

PREWARM_KEY = "_prewarm_prefill_decode"


def pool_configs(parsed: PDAppArgs) -> tuple[LLMConfig, LLMConfig]:
    """The prefill and decode ``LLMConfig``s, validated by Ray Serve LLM's ``PDServingArgs``."""
    from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs

    source = resolve_model_source(parsed)
    configs = {}
    for pool, server_cls in (("prefill", DSv4PDPrefillServer), ("decode", DSv4PDDecodeServer)):
        data = with_http_engine_settings(parsed.pool_llm_config_dict(pool, source),
                                         parsed.http)
        if data.get("experimental_configs", {}).get(PREWARM_KEY):
            raise ValueError(
                f"llm.experimental_configs.{PREWARM_KEY}=true: Ray Serve LLM's pre-warm "
                "sends a request through every prefill replica before the P/D check has "
                "compared them. Fix: remove it (the first checked request does the NIXL "
                "handshake).")
        data["deployment_config"] = pool_router(pool, data["deployment_config"], parsed)
        # Each pool autoscales on its own replicas' KV usage and queue (no DP in P/D).
        data["deployment_config"] = with_autoscaling_policy(
            data["deployment_config"], parsed.dsv4.autoscaling, gang_size=1)
        # The decode replicas answer HTTP (queue bounds); both pools boot without the
        # download task for a local model directory.
        data = serving_config(data, parsed.http) if pool == "decode" else \
            with_boot_callback(data)
        configs[pool] = LLMConfig(**data, server_cls=server_cls)
    args = PDServingArgs.model_validate({"prefill_config": configs["prefill"],
                                         "decode_config": configs["decode"]})
    return args.prefill_config, args.decode_config


def pool_router(pool: str, deployment_config: dict[str, Any],
                parsed: PDAppArgs) -> dict[str, Any]:
    """The prefill pool routes to proven replicas only (``route``); the decode pool, the
    ingress, skips drained replicas: by our router behind Serve's proxy, by failing the
    ``/-/healthz`` HAProxy polls behind HAProxy (Ray 2.60 refuses a custom router on an
    ingress deployment there; the prefill handle is not the ingress and keeps its own)."""
    if pool == "prefill":
        return deployment_config | {"request_router_config": route.router_config()}
    if parsed.http.ingress == "haproxy":
        logger.info("dsv4: http.ingress=haproxy: HAProxy picks the decode replica; a drained "
                    "or engine-dead one fails its /-/healthz and leaves HAProxy's rotation")
        return deployment_config
    return with_kv_router(deployment_config, parsed.dsv4.routing)


def build_pd_app(parsed: PDAppArgs) -> Application:
    """Decode (our ``DSv4PDDecodeServer``, the ingress) -> prefill, and the controller."""
    prefill_config, decode_config = pool_configs(parsed)
    refuse_lora(decode_config.lora_config)
    prefill = build_llm_deployment(prefill_config, name_prefix="Prefill:",
                                   bind_kwargs={"dsv4": parsed.pool_dsv4("prefill")})
    controller = controller_deployment(PDController, parsed).bind(
        prefill=prefill,
        decode=server_deployment_name(DSv4PDDecodeServer, decode_config, DECODE_PREFIX),
        dsv4_prefill=parsed.pool_dsv4("prefill"), dsv4_decode=parsed.pool_dsv4("decode"),
        canary=parsed.pd.canary.model_dump(mode="json"),
        kv_capacity={pool: plan.model_dump(mode="json") for pool, plan in plan_pool_capacities(
            parsed.llm.model_loading_config.model_id, parsed).items()})
    decode_replicas = parsed.pool_deployment_config("decode").max_replicas
    decode = build_llm_deployment(
        decode_config, name_prefix=DECODE_PREFIX,
        deployment_cls=listening_ingress(DSv4PDDecodeServer),
        bind_kwargs={"dsv4": parsed.pool_dsv4("decode"), "prefill_server": prefill,
                     "compat_check": parsed.pd.compat_check}
        | ingress_bind_kwargs(parsed.http, decode_replicas, controller,
                              parsed.pool_deployment_config("decode").drain_timeout_s,
                              parsed.responses))
    logger.info("dsv4: P/D app: %s prefill + %s decode replica(s), connector %s, compat "
                "check %s, output canary %s", parsed.pool_deployment_config("prefill")
                .max_replicas, decode_replicas, parsed.pd.kv_transfer_config.get(
                    "kv_connector"), "on" if parsed.pd.compat_check else "OFF",
                f"every {parsed.pd.canary.period_s:g} s" if parsed.pd.canary.enabled
                else "OFF")
    return decode
