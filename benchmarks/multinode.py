"""Autoscaling end to end on ``dsv4-serve run --nodes 3``, timed step by step.

Load from ``vllm bench serve`` (``deployments.harness.load``) drives Serve's autoscaling
1 -> 2 -> 3 replicas; Ray's autoscaler adds a worker node for each; the KV-spec
verdict includes every new replica. The load ends: Serve scales down to 1 and
the autoscaler removes the idle nodes. Then SIGTERM to the run's process group.
Each step's time (seconds since the load started / since it ended) is printed
as a table for docs/benchmarks.md.

    flock /tmp/dsv4-heavy.lock .venv/bin/python -m benchmarks.multinode

The two tables are written as ``benchmarks/results/multinode_1.json`` (under load) and
``multinode_2.json`` (after it); the load and SIGTERM lines go in their notes.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.results import this_command, write_tables
from deployments.harness import load as bench_load
from deployments.harness import multinode_scenario as mn

NODES = 3
IDLE_TIMEOUT_S = 5.0


def _watch(run: mn.Run, t0: float, marks: dict[str, float], stop: threading.Event) -> None:
    """Record when the replica and node counts first reach each value."""
    while not stop.is_set():
        try:
            rep = mn.report()
        except Exception:  # the ingress may be busy; the next poll tells
            rep = {}
        now = round(time.monotonic() - t0, 1)
        replicas = rep.get("running_replicas") or 0
        if rep.get("state") == "agree":
            marks.setdefault(f"verdict agrees over {replicas} replica(s)", now)
        marks.setdefault(f"{replicas} replica(s) RUNNING", now)
        marks.setdefault(f"{len(mn.worker_nodes(run))} worker node(s)", now)
        marks["pss_mib"] = max(marks.get("pss_mib", 0.0), mn.pss_mib(run.all_pids()))
        time.sleep(1)


def main() -> dict[str, Any]:
    from dsv4_patch.tiny_model import ensure_tiny_model

    config = mn.autoscaling_config_file(Path(tempfile.mkdtemp()), max_replicas=NODES)
    os.environ["OPENAI_API_KEY"] = mn.KEY  # vllm bench serve's key; the door demands one
    started = time.monotonic()
    run = mn.start_run(config, NODES, IDLE_TIMEOUT_S, env=mn.STORY_ENV)
    print(f"boot: serving after {time.monotonic() - started:.1f} s")
    up: dict[str, float] = {}
    down: dict[str, float] = {}
    try:
        mn.wait_report(mn.agreeing(1), "1 replica")
        stop = threading.Event()
        t0 = time.monotonic()
        watcher = threading.Thread(target=_watch, args=(run, t0, up, stop), daemon=True)
        watcher.start()
        load = bench_load.Load(num_prompts=600, concurrency=12, input_len=32, output_len=64)
        result = bench_load.run(load, mn.URL.removesuffix("/v1"), "dsv4-tiny",
                                str(ensure_tiny_model()))
        up["load ended"] = round(time.monotonic() - t0, 1)
        stop.set()
        watcher.join()
        stop = threading.Event()
        t1 = time.monotonic()
        watcher = threading.Thread(target=_watch, args=(run, t1, down, stop), daemon=True)
        watcher.start()
        mn.wait_report(mn.agreeing(1), "scale-down to 1")
        deadline = time.monotonic() + mn.STEP_TIMEOUT_S
        while len(mn.worker_nodes(run)) > 1 and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(2)
        stop.set()
        watcher.join()
    finally:
        code, _, stop_s = mn.stop_run(run)
    summary = (f"load: {result['completed']} completed, {result['failed']} failed, "
               f"{result['output_throughput']:.1f} out tok/s")
    print(summary)
    printed = steps(up, down)
    print(printed)
    peak = max(up.get("pss_mib", 0), down.get("pss_mib", 0)) / 1024
    ending = f"SIGTERM: exit {code} after {stop_s:.1f} s; peak PSS of the run {peak:.1f} GiB"
    print(ending)
    for path in record(printed, load, f"{summary}. {ending}."):
        print(f"wrote {path}")
    return {"up": up, "down": down, "load": bench_load.summary(result), "exit": code}


def steps(up: dict[str, float], down: dict[str, float]) -> str:
    """The two step tables, markdown: under load (s since it started), after (s since
    it ended)."""
    lines = []
    for head, marks in (("under load; s since load start", up),
                        ("after load; s since load end", down)):
        lines += [f"| step ({head}) | s |", "|---|---|"]
        lines += [f"| {name} | {sec} |" for name, sec in sorted(marks.items(),
                                                                key=lambda kv: kv[1])
                  if name != "pss_mib"]
    return "\n".join(lines)


def record(printed: str, load: bench_load.Load, notes: str) -> list[Path]:
    """``benchmarks/results/multinode_1.json`` and ``multinode_2.json``."""
    return write_tables(
        "multinode", printed, title=f"Autoscaling end to end on dsv4-serve run --nodes {NODES}",
        what=("A `vllm bench serve` load drives Serve's autoscaling 1 -> 2 -> 3 replicas and "
              "Ray's autoscaler a worker node for each, the KV-spec verdict over every new "
              "replica; then the scale-down to 1 and the idle nodes' removal. Each step's "
              "time in seconds since the load started / ended."),
        command=this_command("benchmarks.multinode"),
        inputs={"nodes": NODES, "idle_timeout_s": IDLE_TIMEOUT_S, "load": load.__dict__},
        notes=notes)


if __name__ == "__main__":
    main()
