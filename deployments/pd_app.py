"""The P/D application: ingress -> decode pool -> prefill pool, plus one controller.

Ray Serve LLM 2.60's P/D pattern (``serving_patterns/prefill_decode/builder.py``,
``build_pd_openai_app``): the ingress binds the decode deployment only (the model the
client sees), and each decode replica calls the prefill deployment through a handle.
We build the same graph from the same blocks -- ``PDServingArgs`` validates the two
``LLMConfig``s and applies its defaults (the decode pool's NIXL side-channel port base
moves off prefill's), ``build_llm_deployment`` builds each pool with the
``Prefill:``/``Decode:`` name prefixes -- because three things differ: our servers in
both pools, our ingress (``/v1/kv-spec``, the HTTP edge), and ``PDController`` bound to
both pools. The prefill deployment routes with ``deployments.pd_route.PDPrefillRouter``
(only proven-compatible replicas), the decode deployment with ``KVSpecRouter`` (drain).
"""

from __future__ import annotations

from ray.serve.deployment import Application
from ray.serve.llm import LLMConfig, build_llm_deployment

from deployments import pd_route
from deployments.app import bind_ingress, controller_deployment, resolve_model_source
from deployments.logs import get_logger
from deployments.pd_config import PDAppArgs
from deployments.pd_controller import PDController
from deployments.pd_server import DSv4PDDecodeServer, DSv4PDPrefillServer
from deployments.router import with_kv_router

logger = get_logger("pd")

PREWARM_KEY = "_prewarm_prefill_decode"


def pool_configs(parsed: PDAppArgs) -> tuple[LLMConfig, LLMConfig]:
    """The prefill and decode ``LLMConfig``s, validated by Ray Serve LLM's ``PDServingArgs``."""
    from ray.llm._internal.serve.serving_patterns.prefill_decode.builder import PDServingArgs

    source = resolve_model_source(parsed)
    configs = {}
    for pool, server_cls in (("prefill", DSv4PDPrefillServer), ("decode", DSv4PDDecodeServer)):
        data = parsed.pool_llm_config_dict(pool, source)
        if data.get("experimental_configs", {}).get(PREWARM_KEY):
            raise ValueError(
                f"llm.experimental_configs.{PREWARM_KEY}=true: Ray Serve LLM's pre-warm "
                "sends a request through every prefill replica before the P/D check has "
                "compared them. Fix: remove it (the first checked request does the NIXL "
                "handshake).")
        router = pd_route.router_config() if pool == "prefill" else None
        data["deployment_config"] = (data["deployment_config"] | {
            "request_router_config": router}) if router else with_kv_router(
            data["deployment_config"])
        configs[pool] = LLMConfig(**data, server_cls=server_cls)
    args = PDServingArgs.model_validate({"prefill_config": configs["prefill"],
                                         "decode_config": configs["decode"]})
    return args.prefill_config, args.decode_config


def build_pd_app(parsed: PDAppArgs) -> Application:
    """Ingress -> decode (our ``DSv4PDDecodeServer``) -> prefill, and the controller."""
    prefill_config, decode_config = pool_configs(parsed)
    prefill = build_llm_deployment(prefill_config, name_prefix="Prefill:",
                                   bind_kwargs={"dsv4": parsed.pool_dsv4("prefill")})
    decode = build_llm_deployment(decode_config, name_prefix="Decode:", bind_kwargs={
        "dsv4": parsed.pool_dsv4("decode"), "prefill_server": prefill,
        "compat_check": parsed.pd.compat_check})
    controller = controller_deployment(PDController, parsed).bind(
        prefill=prefill, decode=decode, dsv4_prefill=parsed.pool_dsv4("prefill"),
        dsv4_decode=parsed.pool_dsv4("decode"))
    logger.info("dsv4: P/D app: %s prefill + %s decode replica(s), connector %s, compat "
                "check %s", parsed.pool_deployment_config("prefill").max_replicas,
                parsed.pool_deployment_config("decode").max_replicas,
                parsed.pd.kv_transfer_config.get("kv_connector"),
                "on" if parsed.pd.compat_check else "OFF")
    return bind_ingress(parsed, decode_config, decode, controller)
