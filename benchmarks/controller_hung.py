"""Benchmark: KV-spec check time vs replica count with one hung replica.

Real Ray Serve, the real ``KVSpecController``, N stand-in replicas
(``deployments.harness.standin``) of which rank 0 stalls ``kv_page_spec`` for 60 s from its
second call on. Two arms side by side in one run, same fleet sizes:

* **per-replica** (ours): every replica under its own deadline
  (``broadcast_timeout_s``); the check ends after that deadline with N-1 verdicts
  and the hung one named ``no_answer``.
* **all-or-nothing** (the previous controller: ``broadcast(...).results_async(
  timeout_s=...)``): the same deadline discards every answer.

For each N: forced checks (``report(refresh=True)``), their ``check_seconds``,
how many replicas got a verdict, and whether the hung one was named. The
claim under test: the others' verdict never waits longer than the per-replica
timeout (plus the check's own overhead), at any N. Heavy: run alone, e.g.
``flock /tmp/dsv4-heavy.lock timeout 900 python -m benchmarks.controller_hung``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.results import write_result
from deployments.control.controller import KVSpecController
from deployments.local import ray_token

REPO = Path(__file__).resolve().parents[1]
SERVER = "StandInReplica"
HANG_S = 60.0


class AllOrNothingController(KVSpecController):
    """The previous collection: one ``results_async`` deadline for the whole fleet."""

    async def _call_each(self, method: str, *args: Any,
                         **kwargs: Any) -> tuple[list[Any], int, str | None]:
        timeout = self._settings.broadcast_timeout_s
        try:
            answers = await self._server.broadcast(method, *args, **kwargs).results_async(
                timeout_s=timeout, return_exceptions=True)
        except TimeoutError:
            return [], 0, f"broadcast {method} timed out after {timeout}s"
        return answers, 0, None


def build(n: int, timeout_s: float, controller: type) -> Any:
    from ray import serve

    from deployments.harness.standin import StandInReplica

    server = serve.deployment(
        StandInReplica, name=SERVER, num_replicas=n, ray_actor_options={"num_cpus": 0},
        health_check_period_s=30, max_ongoing_requests=1000,
    ).options(version="v1", _internal=True).bind(hang_s={0: HANG_S})
    dsv4 = {"expected_layout": "fp8_ds_mla", "policy": "warn", "controller_period_s": 3600,
            "broadcast_timeout_s": timeout_s}
    return serve.deployment(
        controller, name="KVSpecController", num_replicas=1, ray_actor_options={"num_cpus": 0},
    ).options(version="v1", _internal=True).bind(server=server, dsv4=dsv4)


def measure_arm(arm: str, controller: type, counts: list[int], timeout_s: float,
                repeats: int) -> list[dict[str, Any]]:
    from ray import serve

    app = f"hung-{arm}"
    rows = []
    for n in counts:
        t0 = time.monotonic()
        serve.run(build(n, timeout_s, controller), name=app, route_prefix=None)
        handle = serve.get_deployment_handle("KVSpecController", app)
        # The loop's first check (at start) may predate some replicas: one forced check
        # while nobody hangs yet for those that just started (their first call answers).
        handle.report.remote(refresh=True).result(timeout_s=300)
        checks, answered, named = [], [], []
        for _ in range(repeats):
            rep = handle.report.remote(refresh=True).result(timeout_s=300)
            checks.append(rep["check_seconds"])
            answered.append(rep["answered"])
            named.append(any(r["status"] == "no_answer" for r in rep["replicas"]))
        row = {"arm": arm, "replicas": n, "scale_up_s": round(time.monotonic() - t0, 1),
               "check_s_p50": statistics.median(checks), "check_s_max": max(checks),
               "answered_min": min(answered), "others": n - 1,
               "hung_named": all(named), "state": rep["state"]}
        print(f"{arm:>15} {n:8d} {row['check_s_p50']:11.3f} {row['check_s_max']:11.3f} "
              f"{row['answered_min']:8d}/{n - 1:<4d} {row['hung_named']!s:>6}", flush=True)
        rows.append(row)
    serve.delete(app)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=lambda s: [int(x) for x in s.split(",")],
                        default=[2, 4, 8, 16])
    parser.add_argument("--timeout", type=float, default=2.0,
                        help="per-replica deadline (dsv4.broadcast_timeout_s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "controller_hung.json")
    args = parser.parse_args()
    import ray
    from ray import serve

    # address="local": a private cluster, never someone else's that happens to run.
    ray_token.use_private_token()  # else Ray writes ~/.ray/auth_token 0644
    ray.init(address="local", include_dashboard=False, logging_level="ERROR",
             log_to_driver=False, object_store_memory=200 * 2**20)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8012},
                    proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        print(f"{'arm':>15} {'replicas':>8} {'check p50 s':>11} {'check max s':>11} "
              f"{'verdicts':>13} {'named':>6}", flush=True)
        rows = measure_arm("per-replica", KVSpecController, args.counts, args.timeout,
                           args.repeats)
        rows += measure_arm("all-or-nothing", AllOrNothingController, args.counts,
                            args.timeout, args.repeats)
    finally:
        serve.shutdown()
        ray.shutdown()
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "timeout_s": args.timeout, "hang_s": HANG_S, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    worst = max(r["check_s_max"] for r in rows if r["arm"] == "per-replica")
    print(f"per-replica: slowest check {worst:.2f} s for a {args.timeout} s deadline; "
          f"wrote {args.out}")
    print(f"wrote {write_table(args, rows)}")
    return 0


def write_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> Path:
    """``benchmarks/results/controller_hung_s7_1.json``: the table docs/benchmarks.md shows."""
    counts = ",".join(str(n) for n in args.counts)
    return write_result(
        "controller_hung_s7_1",
        title="7. KV-spec check: one hung replica, and the consensus fault tests (table 1)",
        what=("One replica of N never answers kv_page_spec: how long a check takes and whether "
              "the others are judged and the hung one named, with per-replica deadlines "
              "(serve.broadcast_per_replica_results) and all-or-nothing (results_async); "
              f"{args.repeats} forced checks per count, deadline {args.timeout} s."),
        command=(f"flock /tmp/dsv4-heavy.lock timeout 300 python -m benchmarks.controller_hung "
                 f"--counts {counts} --repeats {args.repeats}"),
        inputs={"counts": args.counts, "timeout_s": args.timeout, "repeats": args.repeats,
                "hang_s": HANG_S},
        columns=["arm", "replicas", "check p50 s", "check max s",
                 "replicas judged / not hung", "hung one named"],
        rows=[[r["arm"], str(r["replicas"]), f"{r['check_s_p50']:.3f}",
               f"{r['check_s_max']:.3f}", f"{r['answered_min']}/{r['others']}",
               "yes" if r["hung_named"] else "no"] for r in rows])


if __name__ == "__main__":
    sys.exit(main())
