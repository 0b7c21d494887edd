"""The server deployment's Serve options, decided without importing Ray Serve LLM's server.

Ray Serve LLM's builder (``build_llm_deployment``, ``LLMServer.get_deployment_options``)
imports vLLM and torch: 8-11 s of one core in the process that builds the app. In
``dsv4-serve run`` and in KubeRay's build task that import ran before any replica could
start, and each replica then imports the same again (docs/benchmarks.md §2d). For the
shape it covers (explicit placement bundles, no TPU, no KV-aware router; one engine per
replica, or DP ranks gang-scheduled as ``DPServer.get_deployment_options`` does) this
module gives the options Ray Serve LLM 2.60 gives from the same config dict, and names the
server class by import path, so only the replica imports vLLM.
``tests/test_deployments/test_server_options.py`` builds every shipped one-pool config
and variants both ways against the installed Ray and names each option that differs.
Anything else goes through Ray Serve LLM's builder (``uncovered`` says why).
Ray touches ``llm.server_options`` and ``serve.import_path_deployment``.
"""

from __future__ import annotations

import copy
from typing import Any

import ray
from ray import serve
from ray.llm._internal.common.dict_utils import maybe_apply_llm_deployment_config_defaults
from ray.llm._internal.serve import constants
from ray.llm._internal.serve.core.configs.accelerators import (
    TPU_ACCELERATOR_VALUES,
    AcceleratorType,
    infer_hardware_kind_from_bundles,
)
from ray.serve.config import (
    AutoscalingConfig,
    GangPlacementStrategy,
    GangRuntimeFailurePolicy,
    GangSchedulingConfig,
)
from ray.serve.deployment import Deployment

from deployments.serving.router import ROUTER_CLASS

# The classes the replicas import (``serve.ingress`` of deployments.serving.server's
# DSv4Server / DSv4DPServer; Serve splits at the last dot), by whether DP is on, and the
# "<class>:" prefix Ray Serve LLM's builder names each deployment by.
SERVER_IMPORT_PATHS = {False: "deployments.serving.server.DSv4Ingress",
                       True: "deployments.serving.server.DSv4DPIngress"}
SERVER_CLASS_NAMES = {False: "DSv4Server", True: "DSv4DPServer"}
SETUP_HOOK = "ray.llm._internal.serve._worker_process_setup_hook"
# Ray Serve LLM's placement-group keys it refuses in deployment_config.
PG_KEYS = ("placement_group_bundles", "placement_group_strategy")


def defaults() -> dict[str, Any]:
    """``DEFAULT_DEPLOYMENT_OPTIONS`` of Ray Serve LLM's builder (its env-set constants)."""
    return {"max_ongoing_requests": constants.DEFAULT_MAX_ONGOING_REQUESTS,
            "health_check_period_s": constants.DEFAULT_HEALTH_CHECK_PERIOD_S,
            "health_check_timeout_s": constants.DEFAULT_HEALTH_CHECK_TIMEOUT_S,
            "autoscaling_config": {
                "target_ongoing_requests": constants.DEFAULT_MAX_TARGET_ONGOING_REQUESTS}}


def gpu_types_kept() -> set[str]:
    """GPU accelerator types ``LLMConfig`` keeps as given: it refuses unknown ones,
    renames A10, and builds TPUs differently, all left to its own builder."""
    return {t.value for t in AcceleratorType} - set(TPU_ACCELERATOR_VALUES) - {"A10"}


def uncovered(config: dict[str, Any]) -> str | None:
    """Why this ``LLMConfig`` dict needs Ray Serve LLM's own builder, or None."""
    pg = config.get("placement_group_config") or {}
    accelerator = config.get("accelerator_type")
    hardware = infer_hardware_kind_from_bundles(pg)
    engine = config.get("engine_kwargs") or {}
    deployment = config.get("deployment_config") or {}
    router = deployment.get("request_router_config")
    router_cls = router.get("request_router_class") if isinstance(router, dict) else router
    reasons = {
        "no explicit placement_group_config.bundles": not pg.get("bundles")
        or "bundle_per_worker" in pg,
        "accelerator_config is set": bool(config.get("accelerator_config")),
        "TPU bundles": hardware == "tpu",
        f"accelerator_type {accelerator!r} (validated by LLMConfig)": accelerator is not None
        and (accelerator not in gpu_types_kept() or hardware != "gpu"),
        "data_parallel_size is not a positive int": not isinstance(
            engine.get("data_parallel_size", 1), int) or engine.get("data_parallel_size", 1) < 1,
        f"request router {router_cls!r}": router_cls not in (None, ROUTER_CLASS),
        "engine_kwargs.kv_events_config is set": engine.get("kv_events_config") is not None,
        "deployment_config sets placement groups": any(k in deployment for k in PG_KEYS),
    }
    return next((why for why, hit in reasons.items() if hit), None)


def dp_size(config: dict[str, Any]) -> int:
    """Data-parallel ranks: each is its own Serve replica, a gang of them one engine."""
    size: int = (config.get("engine_kwargs") or {}).get("data_parallel_size", 1)
    return size


def server_options(config: dict[str, Any]) -> dict[str, Any]:
    """The server deployment's options for ``config`` (an ``LLMConfig`` dict ``uncovered``
    passes): bundles with the replica's own resources merged into the first, strategy,
    the runtime env, DP gangs, the name, then the builder's defaults under the user's."""
    size = dp_size(config)
    options = one_engine_options(config)
    if size > 1:
        options = dp_gang_options(options, size)
    model_id = config["model_loading_config"]["model_id"]
    name = options.get("name", model_id.replace("/", "--").replace(".", "_"))
    options["name"] = SERVER_CLASS_NAMES[size > 1] + ":" + name
    return maybe_apply_llm_deployment_config_defaults(defaults(), options)


def one_engine_options(config: dict[str, Any]) -> dict[str, Any]:
    """``LLMServer.get_deployment_options``: placement group and runtime env."""
    options = copy.deepcopy(config.get("deployment_config") or {})
    actor = options.get("ray_actor_options", {})
    replica = {"CPU": actor.get("num_cpus", 1), "GPU": actor.get("num_gpus", 0),
               **actor.get("resources", {})}
    if "memory" in actor:
        replica["memory"] = actor["memory"]
    pg = config["placement_group_config"]
    options["placement_group_bundles"] = merged_bundles(
        engine_bundles(pg["bundles"], config.get("accelerator_type")), replica)
    options["placement_group_strategy"] = pg.get("strategy", "PACK")
    options["ray_actor_options"] = actor | {"runtime_env": {
        **runtime_env_default(), **actor.get("runtime_env", {}),
        **(config.get("runtime_env") or {})}}
    return options


def dp_gang_options(options: dict[str, Any], size: int) -> dict[str, Any]:
    """``DPServer.get_deployment_options``: replica counts are in gangs of ``size`` ranks,
    packed together and restarted together; the per-replica strategy gives way."""
    options = dict(options)
    replicas = options.get("num_replicas")
    if replicas == "auto" or (replicas is None and "autoscaling_config" in options):
        autoscaling = AutoscalingConfig.default().model_dump()
        autoscaling.update(options.get("autoscaling_config") or {})
        for key in ("min_replicas", "max_replicas", "initial_replicas"):
            if autoscaling.get(key) is not None:
                autoscaling[key] *= size
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = size * (replicas if replicas is not None else 1)
    options["gang_scheduling_config"] = GangSchedulingConfig(
        gang_size=size, gang_placement_strategy=GangPlacementStrategy.PACK,
        runtime_failure_policy=GangRuntimeFailurePolicy.RESTART_GANG)
    options.pop("placement_group_strategy", None)
    return options


def engine_bundles(bundles: list[dict[str, float]],
                   accelerator_type: str | None) -> list[dict[str, float]]:
    """One bundle per engine worker, as given; an accelerator type adds its hint resource."""
    out = [dict(b) for b in bundles]
    if accelerator_type:
        for bundle in out:
            bundle.setdefault(f"accelerator_type:{accelerator_type}", 0.001)
    return out


def merged_bundles(workers: list[dict[str, float]],
                   replica: dict[str, float]) -> list[dict[str, float]]:
    """The replica actor shares the first worker's bundle (same node): their sum, then
    the other workers' bundles."""
    if not workers:
        return [dict(replica)]
    first = workers[0]
    merged = {k: first.get(k, 0) + replica.get(k, 0) for k in set(first) | set(replica)}
    return [merged, *(dict(b) for b in workers[1:])]


def runtime_env_default() -> dict[str, Any]:
    """The builder process's runtime env, plus Ray Serve LLM's worker setup hook."""
    env = dict(ray.get_runtime_context().runtime_env)
    if constants.ENABLE_WORKER_PROCESS_SETUP_HOOK:
        env["worker_process_setup_hook"] = SETUP_HOOK
    return env


class ImportedOnTheReplica:
    """Stands in for the server class in the process that builds the app: Serve replaces
    it with the class ``SERVER_IMPORT_PATHS`` names, which only the replica imports."""


def server_deployment(options: dict[str, Any], dp: bool) -> Deployment:
    """The server deployment: ``options`` on the class named by import path (Ray touch
    ``serve.import_path_deployment``)."""
    return serve.deployment(ImportedOnTheReplica, **options).options(
        func_or_class=SERVER_IMPORT_PATHS[dp])
