"""Benchmark: what Ray's metrics agent pays per vLLM histogram observation, by export path.

Why (issue 34): at one GPU's token rate the node's dashboard agent was a fifth of
vLLM's whole API server per token. vLLM's Ray stat logger (Ray Serve LLM's
``log_engine_metrics``, on by default) observes its inter-token-latency histogram once
per streamed token through ``ray.util.metrics``, and under Ray 2.60's default
OpenTelemetry backend the agent re-records every exported observation, one Python call
each. This runs one private Ray node per cell (bound to 127.0.0.1), an actor observing
vLLM's own inter-token-latency histogram (its buckets, labels and Ray wrapper class) at
a set rate, and reads the agent's CPU (``ray::DashboardAgent``, from ``/proc``) at rest
and under the load, then the histogram back from Ray's Prometheus endpoint (is its sum
exact?). Every rate runs every arm once per round, the order reversed each round.

    flock /tmp/dsv4-heavy.lock python -m benchmarks.metrics_backend \\
        --rates 2500,20000 --seconds 20 --rounds 3 --json results/metrics_backend.json

Arms: ``ray-histogram``, vLLM's ``RayHistogramWrapper`` on Ray 2.60's default backend
(stock Ray Serve LLM); ``bucket-gauges``, dsv4-serve's ``BucketHistogram``
(``deployments.serving.engine_metrics``) on the same backend, what every replica runs;
``opencensus``, vLLM's wrapper on Ray's older exporter (``RAY_enable_open_telemetry=0``),
for comparison only: under Serve it fails every scrape in Ray 2.60 (docs/benchmarks.md
§2k).

Writes ``benchmarks/results/metrics_backend.json``; its next run supersedes the
carried-over ``metrics_backend_s2k_*.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.results import this_command, write_tables
from deployments.local import ray_token

BACKEND_FLAG = "RAY_enable_open_telemetry"
# arm -> (environment, the histogram class the actor observes through)
BACKENDS: dict[str, tuple[dict[str, str], str]] = {
    "ray-histogram": ({}, "vllm"), "bucket-gauges": ({}, "dsv4"),
    "opencensus": ({BACKEND_FLAG: "0"}, "vllm")}
METRIC = "vllm:inter_token_latency_seconds"
EXPORTED = "ray_vllm_inter_token_latency_seconds"
SETTLE_S = 8.0  # the agent's start-up work, before the rest window
EXPORT_S = 12.0  # one metrics report interval (~10 s) after the load, so it is billed


def agent_cpu_s() -> float:
    """User+system CPU seconds of this host's Ray dashboard agents (one per node)."""
    total = 0.0
    for proc in psutil.process_iter(["cmdline", "ppid"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if cmd.startswith("ray::DashboardAgent") and _ours(proc):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def _ours(proc: psutil.Process) -> bool:
    """An agent under a raylet this process started (never someone else's cluster)."""
    me = os.getpid()
    return any(parent.pid == me for parent in proc.parents())


def cell(rate: float, seconds: float, buckets: list[float], kind: str) -> dict[str, Any]:
    """One private Ray node in this process's environment: the agent's CPU at rest and
    under ``rate`` observations per second for ``seconds``, and the scraped histogram.
    ``kind``: ``vllm`` (its RayHistogramWrapper) or ``dsv4`` (BucketHistogram)."""
    import ray

    from deployments.local.ray_head import free_port, loopback_node_ip

    port = free_port()
    with loopback_node_ip():
        ray_token.use_private_token()  # else Ray writes ~/.ray/auth_token 0644
        ray.init(address="local", num_cpus=1, include_dashboard=False,
                 _metrics_export_port=port, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Observer:
        def __init__(self) -> None:
            from vllm.v1.metrics.ray_wrappers import RayHistogramWrapper

            from deployments.serving.engine_metrics import histogram_class

            cls = histogram_class() if kind == "dsv4" else RayHistogramWrapper
            self.hist = cls(METRIC, "benchmark", ["model_name", "engine"], buckets).labels(
                model_name="deepseek-ai/DeepSeek-V4-Flash", engine="0")

        def observe(self, rate: float, seconds: float) -> dict[str, float]:
            """``rate`` observations per second in 10 ms ticks; the observe call's cost."""
            start, done, spent = time.monotonic(), 0, 0.0
            total = int(rate * seconds)
            while done < total:
                owed = min(total, int((time.monotonic() - start) * rate) + 1) - done
                t0 = time.perf_counter()
                for _ in range(owed):
                    self.hist.observe(0.004)
                spent += time.perf_counter() - t0
                done += owed
                time.sleep(0.01)
            return {"observations": done, "observe_us": spent / max(done, 1) * 1e6}

    try:
        observer = Observer.remote()  # type: ignore[attr-defined]  # ray.remote's class wrapper
        time.sleep(SETTLE_S)
        rest0, t0 = agent_cpu_s(), time.monotonic()
        time.sleep(seconds)
        rest_cores = (agent_cpu_s() - rest0) / (time.monotonic() - t0)
        load0, t1 = agent_cpu_s(), time.monotonic()
        done = ray.get(observer.observe.remote(rate, seconds))
        time.sleep(EXPORT_S)
        load_s = agent_cpu_s() - load0
        window = time.monotonic() - t1
        scraped = scrape_histogram(port, done["observations"])
    finally:
        ray.shutdown()
    extra = load_s - rest_cores * window
    return {"rate": rate, "seconds": seconds, **done, "agent_rest_cores": rest_cores,
            "agent_load_cores": load_s / window,
            "agent_us_per_observation": extra / done["observations"] * 1e6, **scraped}


def scrape_histogram(port: int, want: int) -> dict[str, Any]:
    """The histogram's count and sum on Ray's Prometheus endpoint, once all arrived."""
    from deployments.observe import scrape

    deadline, got = time.monotonic() + 30.0, {}
    text = ""
    while time.monotonic() < deadline:
        text = scrape.read(f"http://127.0.0.1:{port}/metrics")
        got = {name.rsplit("_", 1)[1]: value
               for name, series in scrape.samples(text).items()
               if name in (f"{EXPORTED}_count", f"{EXPORTED}_sum")
               for _labels, value in series}
        if got.get("count", 0) >= want:
            break
        time.sleep(1.0)
    return {"scraped_count": got.get("count", 0.0), "scraped_sum": got.get("sum", 0.0),
            "true_sum": 0.004 * want, "otel_labels": "otel_scope_name" in text}


def run_cell(arm: str, rate: float, seconds: float, buckets: list[float]) -> dict[str, Any]:
    """``cell`` in a fresh process with ``arm``'s environment (Ray reads it at start)."""
    extra, kind = BACKENDS[arm]
    env = {k: v for k, v in os.environ.items() if k != BACKEND_FLAG} | extra
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.metrics_backend", "--cell",
         json.dumps({"rate": rate, "seconds": seconds, "buckets": buckets, "kind": kind})],
        env=env, capture_output=True, text=True, timeout=seconds * 2 + 180, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{arm} at {rate}/s failed (rc {out.returncode}):\n"
                           f"{out.stderr[-3000:]}")
    return {"backend": arm, **json.loads(out.stdout.strip().splitlines()[-1])}


def itl_buckets() -> list[float]:
    """vLLM's own inter-token-latency buckets (the installed release)."""
    from vllm.v1.metrics.buckets import histogram_buckets

    return [float(b) for b in histogram_buckets("inter_token_latency")]


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Medians over rounds per (rate, backend), min-max beside, and the ratio."""
    lines = ["| obs/s | arm | agent at rest, cores | agent under load, cores | agent us per "
             "observation | observe() us in the actor | scraped sum / true | rounds |",
             "|---|---|---|---|---|---|---|---|"]
    for rate in sorted({r["rate"] for r in rows}):
        for backend in BACKENDS:
            cells = [r for r in rows if r["rate"] == rate and r["backend"] == backend]
            if not cells:
                continue

            def fmt(key: str, digits: int, of: list[dict[str, Any]] = cells) -> str:
                values = [c[key] for c in of]
                return (f"{statistics.median(values):.{digits}f} "
                        f"({min(values):.{digits}f}-{max(values):.{digits}f})")

            ratio = statistics.median(c["scraped_sum"] / c["true_sum"] for c in cells)
            lines.append(f"| {rate:g} | {backend} | {fmt('agent_rest_cores', 4)} | "
                         f"{fmt('agent_load_cores', 4)} | {fmt('agent_us_per_observation', 2)} | "
                         f"{fmt('observe_us', 2)} | {ratio:.3f} | {len(cells)} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="2500,20000")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", default=",".join(BACKENDS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        spec = json.loads(args.cell)
        print(json.dumps(cell(spec["rate"], spec["seconds"], spec["buckets"], spec["kind"])))
        return 0
    buckets, rows = itl_buckets(), []
    rates = [float(r) for r in args.rates.split(",")]
    for round_no in range(args.rounds):
        arms = [a for a in BACKENDS if a in args.arms.split(",")]
        order = arms if round_no % 2 == 0 else arms[::-1]
        for rate in rates:
            for backend in order:
                row = run_cell(backend, rate, args.seconds, buckets) | {"round": round_no}
                rows.append(row)
                print(f"round {round_no} {backend} {rate:g}/s: agent "
                      f"{row['agent_us_per_observation']:.2f} us/obs, load "
                      f"{row['agent_load_cores']:.4f} cores, sum "
                      f"{row['scraped_sum']:.3f}/{row['true_sum']:.3f}", flush=True)
    printed = "\n".join(table(rows))
    print(printed)
    record(printed, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "buckets": buckets}, indent=1))
    return 0


def record(printed: str, args: argparse.Namespace) -> Path:
    """The printed table as ``benchmarks/results/metrics_backend.json``."""
    [path] = write_tables(
        "metrics_backend", printed,
        title="Ray's metrics agent per vLLM histogram observation, by export path",
        what=("What Ray's dashboard agent pays per observation of vLLM's inter-token-latency "
              "histogram, by export path: an actor observes at a set rate on a private Ray "
              "node per cell; the agent's CPU at rest and under the load, observe() in the "
              "actor, and whether the scraped sum is exact. Medians over rounds (min-max)."),
        command=this_command("benchmarks.metrics_backend"),
        inputs={"rates": args.rates, "seconds": args.seconds, "rounds": args.rounds,
                "arms": args.arms})
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    raise SystemExit(main())
