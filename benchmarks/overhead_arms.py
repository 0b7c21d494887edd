"""The arms of ``benchmarks.serving_overhead``: what each one boots and how a client reaches it.

``ours`` is what ``dsv4-serve run`` runs; the others vary one thing (Serve's proxy,
stock Ray Serve LLM, the controller period, Serve's throughput mode, direct ingress,
HAProxy); ``vllm`` is plain ``vllm serve`` (its command lives with the arm lifecycle).
"""

from __future__ import annotations

import copy
import importlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "local-cpu.yaml"
SERVE_ARMS = ("ours", "ours-proxy", "stock", "ours-quiet", "ours-tput", "ours-direct",
              "ours-haproxy", "ours-raydefaults", "ours-si8", "ours-haproxy-inline", "ours-rsl")
# The 2-node arms (``benchmarks.multinode_arms``): ``dsv4-serve run --nodes 2``, each door.
# mn-haproxy-1: the same door with one replica on one worker node, so its engine count
# is plain vLLM's (the 2-replica arms run two engines on the same 2 cores).
MN_ARMS = ("mn-proxy", "mn-haproxy", "mn-replica-port", "mn-haproxy-1", "mn-haproxy-inline-1",
           "mn-haproxy-ray-1")
ARMS = ("ours", "ours-proxy", "vllm", *SERVE_ARMS[2:], *MN_ARMS)
# Arms whose replicas listen themselves: the edge requires a key even on loopback.
KEYED_ARMS = ("ours-direct", "ours-haproxy", "ours-haproxy-inline", "mn-haproxy",
              "mn-haproxy-1", "mn-haproxy-inline-1", "mn-haproxy-ray-1")
# ours-direct: the key the arm's replicas require and its client sends.
DIRECT_KEY = "bench-direct-ingress-key"


def client_port(arm: str, port: int) -> int:
    """Where the load goes: Serve's proxy (``port``), or the replica itself under
    direct ingress (the next port, the only one Serve's port range then holds)."""
    return port + 1 if arm == "ours-direct" else port


def arm_env(arm: str, port: int) -> dict[str, str]:
    """Environment of an arm's server process (Ray's processes inherit it)."""
    from deployments import serve_env

    if arm == "ours-raydefaults":  # Serve's own values: a set value wins over ours
        return {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1",
                "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "100"}
    if arm == "ours-haproxy-inline":  # the same, the replica's user code on Serve's own loop
        return arm_env("ours-haproxy", port) | {USER_THREAD_FLAG: "0"}
    if arm == "ours-haproxy":  # http.ingress: haproxy (raw_config), as run would set it
        return {**serve_env.haproxy_env(serve_env.haproxy_binary()),
                **serve_env.ingress_tuning(), **serve_env.direct_env(port + 1),
                "RAY_SERVE_HAPROXY_STATS_PORT": str(port + 2),
                "RAY_SERVE_HAPROXY_METRICS_PORT": str(port + 3),
                "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(port + 4),
                "DSV4_API_KEYS": DIRECT_KEY}
    if arm != "ours-direct":
        return {}

    return {**serve_env.direct_env(port + 1), "DSV4_API_KEYS": DIRECT_KEY}


def client_env(arm: str) -> dict[str, str]:
    """What the load client needs (``vllm bench serve`` reads ``OPENAI_API_KEY``)."""
    return {"OPENAI_API_KEY": DIRECT_KEY} if arm in KEYED_ARMS else {}
# The OpenAiIngress replica stock build_openai_app adds asks for Serve's default 1 CPU;
# ours has no ingress replica (the servers are the ingress), so our sizing has no room.
STOCK_INGRESS_CPUS = 1.0
# Ablation arm: ours with the KV-spec controller's periodic check pushed out to its
# maximum period, so it runs once at start; isolates what the periodic check costs.
QUIET_PERIOD_S = 3600.0
# Ablation arm ours-si8 (issue 34): vLLM's engine arg stream_interval (0.20+; the first
# token is always sent at once), the chunk coalescing the GPU-rate simulation measures.
STREAM_INTERVAL = 8
MODEL_ID = "dsv4-tiny"
# Arms whose requests enter through one of Serve's own doors (its proxy, direct ingress,
# HAProxy), not the replicas' shared port; and where the others put Serve's proxy.
SERVE_DOOR_ARMS = ("ours-proxy", "stock", "ours-tput", "ours-direct", "ours-haproxy",
                   "ours-haproxy-inline")
PROXY_OFFSET = 5
# Ablation arm ours-haproxy-inline (issue 34): Serve runs a replica's user code on a
# thread of its own by default, so every ASGI message of a stream crosses threads
# (call_soon_threadsafe) to reach the direct-ingress server on Serve's loop.
USER_THREAD_FLAG = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"
READY = "DSV4-ARM-READY"
# Ablation arm ours-rsl (issue 34, boot): ours with the server deployment built by Ray
# Serve LLM's builders, as before the import-path build: the driver imports vLLM (in a
# thread beside Ray's start, as run's preload did) and binds an LLMConfig.
RSL_MODULE = "deployments.serving.llm_build"


def raw_config(replicas: int, port: int, arm: str = "ours") -> dict[str, Any]:
    """``configs/local-cpu.yaml`` with ``replicas`` engines and the benchmark port.

    Every arm's engine gets this config's ``runtime_env.env_vars`` (the Serve arms
    through Ray, the plain-vLLM arm in its process environment), so the engines run
    with the same threading: ``OMP_NUM_THREADS`` left unset would give the Serve
    arms 1 thread (Ray's default for a 1-CPU actor) and plain vLLM 2 (torch's).
    """
    raw = yaml.safe_load(CONFIG.read_text())
    args = raw["applications"][0]["args"]
    if arm in SERVE_DOOR_ARMS:  # Serve's own ingress paths: the load goes to Serve's port
        raw["http_options"]["port"] = port
        args["http"].pop("replica_port", None)
    else:  # the replicas' own port, Serve's proxy beside it
        raw["http_options"]["port"] = port + PROXY_OFFSET
        args["http"]["replica_port"] = port
    auto = args["llm"]["deployment_config"]["autoscaling_config"]
    auto["min_replicas"] = auto["max_replicas"] = replicas
    if arm == "ours-quiet":
        args["dsv4"]["controller_period_s"] = QUIET_PERIOD_S
    if arm.startswith("ours-haproxy"):
        args["http"]["ingress"] = "haproxy"
    if arm == "ours-si8":  # vLLM's stream_interval: one chunk per 8 tokens, first at once
        args["llm"]["engine_kwargs"]["stream_interval"] = STREAM_INTERVAL
    return raw


def engine_env() -> dict[str, str]:
    """The environment every arm's engine runs with (recorded with the results)."""
    return dict(app_args(1)["llm"]["runtime_env"]["env_vars"])


def app_args(replicas: int) -> dict[str, Any]:
    """``build_app`` args of the local CPU config, scaled to ``replicas``."""
    return copy.deepcopy(raw_config(replicas, 0)["applications"][0]["args"])


def stock_app(replicas: int) -> Any:
    """Stock Ray Serve LLM: ``build_openai_app`` with the same engine and placement."""
    from ray.serve.llm import LLMConfig, build_openai_app

    from dsv4_patch.tiny_model import ensure_tiny_model

    llm = app_args(replicas)["llm"]
    config = LLMConfig(
        model_loading_config={"model_id": MODEL_ID, "model_source": str(ensure_tiny_model())},
        engine_kwargs=llm["engine_kwargs"],
        deployment_config=llm["deployment_config"],
        placement_group_config=llm["placement_group_config"],
        runtime_env=llm["runtime_env"],
    )
    return build_openai_app({"llm_configs": [config]})


def serve_arm(arm: str, port: int, replicas: int) -> int:
    """Run one Serve arm in this process until SIGTERM (the arm's server process).

    Every Serve arm starts Ray the way ``dsv4-serve run`` does (``ray_head.start_cluster``:
    a private cluster with the logical CPUs the replicas reserve, Ray Serve's default
    environment but for ours-tput). The application is ours (``deploy.deploy`` ->
    ``build_app``) or stock.
    """
    from ray import serve

    from deployments import serve_env
    from deployments.config import ServeConfig
    from deployments.local import deploy, ray_head

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    config = ServeConfig.model_validate(raw_config(replicas, port, arm))
    phase("imports done")
    preload = None
    if arm != "stock":
        preload = deploy.preload_app_module()  # what `dsv4-serve run` does
    rsl = None
    if arm == "ours-rsl":
        rsl = threading.Thread(target=importlib.import_module, args=(RSL_MODULE,),
                               daemon=True)
        rsl.start()
    try:
        cpus = None
        if arm == "stock":
            cpus = max(float(os.cpu_count() or 1),
                       ray_head.logical_cpus_needed(config) + STOCK_INGRESS_CPUS)
        if arm == "ours-tput":  # before Ray starts its processes: they inherit the flags
            for line in serve_env.apply():
                print(line, flush=True)
        if arm in KEYED_ARMS:  # arm_env set the flags in this process's environment
            print("dsv4: Ray Serve env " + ", ".join(
                f"{k}={v}" for k, v in os.environ.items()
                if k.startswith("RAY_SERVE_")), flush=True)
        serve_up = ray_head.start_cluster(config, cpus, on_ray_up=lambda: phase("Ray up"),
                                          wait_for_proxies=arm == "stock")
        phase("Ray + Serve started")
        if preload is not None:  # deploy needs the app's classes: the import is on the path
            preload.join()
            if rsl is not None:
                rsl.join()
                build_with_ray_serve_llm()
            phase("app module imported")
        if arm != "stock":
            deploy.deploy(config)
        else:
            serve.run(stock_app(replicas), name="dsv4", route_prefix="/")
        serve_up.proxies_ready()  # as `dsv4-serve run`: after the deploy
        phase("app RUNNING")
        process_phases()
        print(READY, flush=True)
        stop.wait()
    finally:
        ray_head.shutdown()
    return 0


def build_with_ray_serve_llm() -> None:
    """The ours-rsl arm: every config goes to Ray Serve LLM's builders."""
    from deployments.serving import builder

    builder.uncovered = lambda config: "the ours-rsl benchmark arm"  # an ablation


PHASE = "DSV4-PHASE"


def process_phases() -> None:
    """Boot milestones read off the processes of this arm (it leads its session): when
    Serve's controller and proxy, the server replica, the engine core and its worker
    were created, from their start times."""
    import psutil

    from benchmarks.arm_procs import role_of, session_processes

    t0 = float(os.environ.get("DSV4_ARM_T0", time.time()))
    first: dict[str, float] = {}
    for proc in session_processes(os.getpid()):
        try:
            role, created = role_of(proc), proc.create_time()
        except psutil.NoSuchProcess:
            continue
        if role in ("serve-controller", "proxy", "server", "controller", "engine",
                    "engine-worker"):
            first[role] = min(first.get(role, created), created)
    for role, created in sorted(first.items(), key=lambda kv: kv[1]):
        print(f"{PHASE} {created - t0:.2f} {role} process started", flush=True)


def phase(name: str) -> None:
    """Print a boot milestone: seconds since the benchmark started this process."""
    t0 = float(os.environ.get("DSV4_ARM_T0", time.time()))
    print(f"{PHASE} {time.time() - t0:.2f} {name}", flush=True)
