"""The server deployment built by import path is the one Ray Serve LLM's builder builds.

``deployments.serving.server_options`` gives the server deployment's Serve options without
importing Ray Serve LLM's server (vLLM, torch), for the configs it covers. Each case here
builds the deployment both ways on the installed Ray Serve LLM and compares every
option Serve receives, naming the ones that differ. The builder reads the runtime env
of a connected Ray, so these run in the test session's cluster (``serve_stack``); the
light import itself is checked in a fresh interpreter.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments.config import AppArgs, PDAppArgs, load_serve_config, parse_app_args
from deployments.serving import builder, server_options
from deployments.serving.server_options import merged_bundles, uncovered

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
HEAVY = ("torch", "vllm", "ray.serve.llm", "ray.llm._internal.serve.core.server.llm_server")


def raw_args(name: str) -> dict[str, Any]:
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    return copy.deepcopy(raw["applications"][0]["args"])


def shipped(name: str) -> AppArgs | PDAppArgs:
    """The first app's args of a shipped config, policy problems left in (some presets
    show a refusal on purpose; their options are built all the same)."""
    return load_serve_config(CONFIGS / f"{name}.yaml", refuse=False).ours()[0][1]


def covered_configs() -> list[str]:
    """Every shipped config whose first app is one pool that ``server_options`` covers."""
    names = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        args = shipped(path.stem)
        if not isinstance(args, PDAppArgs) and uncovered(builder.server_config(args)) is None:
            names.append(path.stem)
    return names


def with_changes(name: str, **llm: Any) -> dict[str, Any]:
    """``name``'s args with ``llm`` keys deep-merged over its ``llm`` section."""
    args = raw_args(name)
    for key, value in llm.items():
        section = args["llm"].get(key)
        args["llm"][key] = section | value if isinstance(section, dict) and \
            isinstance(value, dict) else value
    return args


VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "actor options": ("local-cpu", {"deployment_config": {"ray_actor_options": {
        "num_cpus": 0.5, "memory": 2**30, "resources": {"dsv4_node": 1},
        "runtime_env": {"env_vars": {"A": "from-actor", "B": "from-actor"}}}},
        "runtime_env": {"env_vars": {"B": "from-llm"}}}),
    "fixed replicas": ("local-cpu", {"deployment_config": {
        "num_replicas": 2, "autoscaling_config": None}}),
    "own bounds and name": ("local-cpu", {"deployment_config": {
        "max_ongoing_requests": 7, "health_check_period_s": 3, "name": "mine"}}),
    "HAProxy door": ("local-cpu", {}),
    "accelerator and PACK": ("pro-h200-2node", {"accelerator_type": "H200",
                                                "placement_group_config": {"strategy": "PACK"}}),
    "DP fixed replicas": ("flash-h200", {"deployment_config": {
        "num_replicas": 2, "autoscaling_config": None}}),
    "DP autoscaling from 0": ("flash-h200", {"deployment_config": {"autoscaling_config": {
        "min_replicas": 0, "max_replicas": 3, "initial_replicas": 1}}}),
}


def deployment_of(app: Any) -> dict[str, Any]:
    """Everything Serve is given for the app's deployment, as comparable plain data."""
    d = app._bound_deployment  # the Deployment an Application wraps
    replica = d._replica_config
    kwargs = dict(replica.init_kwargs)
    llm_config = kwargs.pop("llm_config")
    if not isinstance(llm_config, dict):
        llm_config = llm_config.model_dump(exclude={"server_cls"})
    else:  # validated as the replica validates it
        from deployments.serving.server import as_llm_config

        llm_config = as_llm_config(llm_config, object()).model_dump(exclude={"server_cls"})
    config = d._deployment_config.model_dump(mode="json")
    config["user_configured_option_names"] = sorted(config["user_configured_option_names"])
    return {"name": d.name, "deployment_config": config,
            "ray_actor_options": json.loads(json.dumps(replica.ray_actor_options, default=str)),
            "placement_group_bundles": replica.placement_group_bundles,
            "placement_group_strategy": replica.placement_group_strategy,
            "max_replicas_per_node": replica.max_replicas_per_node,
            "init_kwargs": kwargs, "llm_config": llm_config}


def differences(ours: dict[str, Any], ray: dict[str, Any], path: str = "") -> list[str]:
    """Each leaf that differs, named by its path."""
    if isinstance(ours, dict) and isinstance(ray, dict):
        return [d for k in sorted(set(ours) | set(ray), key=str)
                for d in differences(ours.get(k, "<absent>"), ray.get(k, "<absent>"),
                                     f"{path}.{k}")]
    return [] if ours == ray else [f"{path}: import path {ours!r}, Ray Serve LLM {ray!r}"]


def both_ways(args: AppArgs) -> tuple[dict[str, Any], dict[str, Any]]:
    from deployments.serving.llm_build import RayServeLLMServer

    config = builder.server_config(args)
    assert uncovered(config) is None, uncovered(config)
    kwargs = {"dsv4": {"policy": "warn"}, "serving_replicas": 2}
    light, ray = builder.ImportPathServer(config), RayServeLLMServer(config)
    assert light.name == ray.name
    return deployment_of(light.bind(kwargs)), deployment_of(ray.bind(kwargs))


@pytest.mark.slow
@pytest.mark.parametrize("name", covered_configs())
def test_shipped_config_builds_as_ray_serve_llm_builds_it(serve_stack: Any, name: str) -> None:
    args = shipped(name)
    assert isinstance(args, AppArgs)
    ours, ray = both_ways(args)
    assert not differences(ours, ray), differences(ours, ray)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_builds_as_ray_serve_llm_builds_it(serve_stack: Any, variant: str) -> None:
    name, llm = VARIANTS[variant]
    args = with_changes(name, **llm)
    if variant == "HAProxy door":  # HAProxy forwards to each replica's own port
        args["http"] = {k: v for k, v in args.get("http", {}).items()
                        if k != "replica_port"} | {"ingress": "haproxy"}
    ours, ray = both_ways(parse_app_args(args))
    assert not differences(ours, ray), differences(ours, ray)


def test_every_shipped_one_pool_config_is_covered() -> None:
    """The local default and every one-pool GPU preset (DP gangs too) are built by
    import path; only P/D apps import Ray Serve LLM's builders."""
    one_pool = [p.stem for p in sorted(CONFIGS.glob("*.yaml"))
                if not isinstance(shipped(p.stem), PDAppArgs)]
    assert {"local-cpu", "flash-h200", "pro-h200-2node"} <= set(one_pool)
    assert covered_configs() == one_pool


def test_other_routers_and_bundles_go_to_ray_serve_llm() -> None:
    config = builder.server_config(parse_app_args(raw_args("local-cpu")))
    assert uncovered(config) is None
    dp = copy.deepcopy(config)
    dp["engine_kwargs"]["data_parallel_size"] = "2"
    assert uncovered(dp) == "data_parallel_size is not a positive int"
    other = copy.deepcopy(config)
    other["deployment_config"]["request_router_config"] = {"request_router_class": "x.Y"}
    assert uncovered(other) == "request router 'x.Y'"
    for accelerator in ("A10", "H2OO", "TPU-V5P"):  # renamed, unknown, TPU: LLMConfig decides
        odd = copy.deepcopy(config) | {"accelerator_type": accelerator}
        assert uncovered(odd) == f"accelerator_type {accelerator!r} (validated by LLMConfig)"
    on_cpu = copy.deepcopy(config) | {"accelerator_type": "H200"}  # CPU bundles: refused there
    assert uncovered(on_cpu) == "accelerator_type 'H200' (validated by LLMConfig)"
    tpu = copy.deepcopy(config)
    tpu["placement_group_config"]["bundles"] = [{"TPU": 4}]
    assert uncovered(tpu) == "TPU bundles"
    per_worker = copy.deepcopy(config)
    per_worker["placement_group_config"] = {"bundle_per_worker": {"GPU": 1}}
    assert uncovered(per_worker) == "no explicit placement_group_config.bundles"


def test_the_replica_shares_the_first_worker_bundle() -> None:
    assert merged_bundles([{"GPU": 1, "CPU": 4}, {"GPU": 1}], {"CPU": 1, "GPU": 0}) == [
        {"GPU": 1, "CPU": 5}, {"GPU": 1}]
    assert merged_bundles([], {"CPU": 1}) == [{"CPU": 1}]


def test_building_the_app_imports_no_vllm() -> None:
    """What ``dsv4-serve run``'s driver and KubeRay's build task import for the one-pool
    app, and the touches they probe: no vLLM, torch or Ray Serve LLM's server."""
    code = ("import sys, deployments.app, deployments.local.deploy\n"
            "from deployments import ray_touches\n"
            "for t in ray_touches.TOUCHES:\n"
            "    if not t.loads_llm and not t.pd_only:\n"
            "        t.probe()\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_the_replica_loads_the_server_class_from_its_import_path() -> None:
    """As Serve's replica does (``_load_deployment_def_from_import_path``)."""
    from ray.serve._private.replica import _load_deployment_def_from_import_path

    from deployments.serving.server import DSv4DPIngress, DSv4DPServer, DSv4Ingress, DSv4Server

    paths = server_options.SERVER_IMPORT_PATHS
    loaded = _load_deployment_def_from_import_path(paths[False])
    assert loaded is DSv4Ingress and issubclass(loaded, DSv4Server)
    loaded = _load_deployment_def_from_import_path(paths[True])
    assert loaded is DSv4DPIngress and issubclass(loaded, DSv4DPServer)
