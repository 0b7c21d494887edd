"""Benchmark: how long the KV-spec controller takes to reach a verdict, vs replica count.

Real Ray Serve, the real ``KVSpecController`` deployment, watching a deployment of
stand-in replicas (``deployments.harness.standin.StandInReplica``: the ``DSv4Server``
controller contract without a vLLM engine, so 256 fit on one box). For each
replica count N, scaled up in place (same deployment version, only
``num_replicas`` changes, as Serve autoscaling does):

* ``verdict_after_running_s``: from ``serve.run`` returning (all N RUNNING) until
  the controller's periodic loop reports ``agree`` with N answers -- what an
  operator waits after a scale-up; bounded by one ``--period`` plus one check.
* ``check_s`` p50/max: one forced check (``report(refresh=True)``), the steady
  state: count RUNNING replicas via ``serve.status()``, broadcast ``kv_page_spec``
  with the fingerprints held (each replica answers briefly), decide, and send the
  verdict only if some replica's changed. Measured inside the controller
  (``check_seconds``) and at the caller (``call_s``, adds one handle round trip).
* ``full_check_s`` p50: a forced check that first forgets every held spec
  (``report(full=True)``): every replica sends its ~50 kB spec, the controller
  validates and re-hashes each -- the first check of a restarted controller.
* ``check_cpu_s`` p50: the CPU seconds the controller process used during a forced
  check (the report's ``check_cpu_seconds``): its own cost, apart from waiting for
  the replicas or for a core;
* ``cpu_at_rest_pct``: per process role, the share of the machine the cluster used
  over ``REST_S`` seconds with only the periodic check running -- on one box the
  stand-ins' own Serve loops compete with the controller, which a real cluster
  (a node per replica) does not have; ``--standin-env`` sets the stand-ins'
  environment (e.g. Serve's metrics export interval) to show what that costs;
* ``decide_ms``: ``deployments.control.verdict.decide`` alone on N stand-in specs (the
  pure part: per-layer prediction check + peer check), to show where the time goes.

Also the system memory the stand-ins took (the limit on N here). Prints a table,
writes JSON (``--out``). Heavy: run alone, e.g.
``flock /tmp/dsv4-heavy.lock timeout 1500 python -m benchmarks.controller_scaling``.

Writes ``benchmarks/results/controller_scaling.json`` (after every count); its next run
supersedes the carried-over ``controller_scaling_s1.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.results import this_command, write_result
from deployments.control.verdict import decide
from deployments.local import ray_token

REPO = Path(__file__).resolve().parents[1]
APP = "kvbench"
SERVER = "StandInReplica"
DEFAULT_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def build(n: int, period_s: float, timeout_s: float,
          standin_env: dict[str, str] | None = None) -> Any:
    """The benchmark app: the real controller bound to N stand-in replicas.

    Fixed versions make a change of ``num_replicas`` an in-place scale, not a
    redeploy, so each step adds replicas to a running fleet -- what ``serve deploy``
    of a config whose only change is ``num_replicas`` does (that path versions
    deployments by config hash). ``serve.run`` from Python gives every call a random
    version (a rolling restart) unless one is set, and setting it is internal-only
    in Ray 2.60, hence ``_internal=True``. ``measure`` checks the scale was in place.
    """
    from ray import serve

    from deployments.control.controller import KVSpecController
    from deployments.harness.standin import StandInReplica

    actor: dict[str, Any] = {"num_cpus": 0}
    if standin_env:  # the stand-ins' own settings only; the controller keeps Ray's defaults
        actor["runtime_env"] = {"env_vars": dict(standin_env)}
    server = serve.deployment(
        StandInReplica, name=SERVER, num_replicas=n,
        ray_actor_options=actor, health_check_period_s=30,
        max_ongoing_requests=1000,
    ).options(version="v1", _internal=True).bind()
    dsv4 = {"expected_layout": "fp8_ds_mla", "policy": "enforce",
            "controller_period_s": period_s, "broadcast_timeout_s": timeout_s}
    return serve.deployment(
        KVSpecController, name="KVSpecController", num_replicas=1,
        ray_actor_options={"num_cpus": 0},
    ).options(version="v1", _internal=True).bind(server=server, dsv4=dsv4)


def decide_ms(n: int, repeats: int = 5) -> float:
    """Median wall time of ``decide`` over N stand-in-shaped specs, in ms."""
    from deployments.harness.standin import standin_spec

    one = standin_spec("r0", 0)
    specs = [one.model_copy(update={"replica_id": f"r{i}", "rank": i}) for i in range(n)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        report = decide(specs, [], n, "fp8_ds_mla")
        times.append((time.perf_counter() - t0) * 1e3)
        if report.state.value != "agree":
            raise RuntimeError(f"decide on {n} identical specs said {report.state}")
    return statistics.median(times)


HEADROOM_MIB = 3000  # left free for the rest of the machine


def fits(last: dict[str, Any], n: int, base_mem: float) -> bool:
    """Whether N replicas fit, extrapolating the memory per replica measured so far."""
    import psutil

    per_replica = max(last["memory_mib_over_base"], 1) / last["replicas"]
    more = per_replica * (n - last["replicas"])
    return psutil.virtual_memory().available / 2**20 - more > HEADROOM_MIB


def used_memory_mib() -> float:
    import psutil

    vm = psutil.virtual_memory()
    return (vm.total - vm.available) / 2**20


async def _wait_verdict(controller: Any, n: int, deadline_s: float) -> dict[str, Any]:
    """Poll the cached report (no forced check) until the loop says agree with N answers."""
    end = time.monotonic() + deadline_s
    while True:
        report = await controller.report.remote()
        if report["state"] == "agree" and report["answered"] == n:
            return report
        if time.monotonic() > end:
            raise TimeoutError(f"no agree verdict with {n} replicas within {deadline_s}s; "
                               f"last: {report['state']} {report['problems'][:2]}")
        await asyncio.sleep(0.05)


async def _forced_checks(controller: Any, n: int, repeats: int,
                         full: bool = False) -> tuple[list, list, list]:
    """(check_seconds, caller round trips, check_cpu_seconds) of ``repeats`` forced checks."""
    checks, calls, cpu = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        report = await controller.report.remote(refresh=True, full=full)
        calls.append(time.perf_counter() - t0)
        if report["state"] != "agree" or report["answered"] != n:
            raise RuntimeError(f"forced check at N={n}: {report['state']}, "
                               f"{report['answered']} answered; {report['problems'][:2]}")
        checks.append(report["check_seconds"])
        cpu.append(report["check_cpu_seconds"])
    return checks, calls, cpu


REST_S = 10.0  # window over which the fleet's CPU at rest is sampled


def cpu_at_rest(seconds: float = REST_S) -> dict[str, float]:
    """Per role, the share of the machine (100 = every core) the cluster used while
    nothing but the controller's periodic check ran: who competes with a check."""
    import psutil

    from benchmarks.arm_procs import cpu_by_role

    procs = psutil.Process().children(recursive=True)
    before = cpu_by_role(procs)
    time.sleep(seconds)
    after = cpu_by_role(procs)
    cores = os.cpu_count() or 1
    return {role: round(100 * (after[role] - before.get(role, 0.0)) / (seconds * cores), 1)
            for role in sorted(after)}


def measure(counts: list[int], period_s: float, repeats: int, save: Any = None,
            standin_env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Scale up through ``counts``; ``save(rows)`` after each row, so a timeout keeps data."""
    import ray
    from ray import serve

    ray_token.use_private_token()  # else Ray writes ~/.ray/auth_token 0644
    ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             object_store_memory=200 * 2**20)
    rows: list[dict[str, Any]] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8011},
                    proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        base_mem = used_memory_mib()
        previous: set[str] = set()
        for n in counts:
            if rows and not fits(rows[-1], n, base_mem):
                print(f"{n:8d} skipped: would leave under {HEADROOM_MIB} MiB free", flush=True)
                rows.append({"replicas": n, "skipped": "memory"})
                break
            t0 = time.monotonic()
            serve.run(build(n, period_s, timeout_s=120.0, standin_env=standin_env), name=APP,
                      route_prefix=None)
            running = time.monotonic()
            controller = serve.get_deployment_handle("KVSpecController", APP)
            verdict = asyncio.run(_wait_verdict(controller, n, deadline_s=period_s + 300))
            after = time.monotonic() - running
            checks, calls, cpu = asyncio.run(_forced_checks(controller, n, repeats))
            full, _, _ = asyncio.run(_forced_checks(controller, n, repeats, full=True))
            rest = cpu_at_rest()
            ids = {r["id"] for r in verdict["replicas"]}
            row = {
                "replicas": n,
                "scaled_in_place": previous <= ids,
                "scale_up_s": round(running - t0, 2),
                "verdict_after_running_s": round(after, 3),
                "periodic_check_s": verdict["check_seconds"],
                "check_s_p50": statistics.median(checks),
                "check_s_max": max(checks),
                "call_s_p50": statistics.median(calls),
                "check_cpu_s_p50": statistics.median(cpu),
                "full_check_s_p50": statistics.median(full),
                "decide_ms": decide_ms(n),
                "memory_mib_over_base": round(used_memory_mib() - base_mem),
                "cpu_at_rest_pct": rest,
            }
            rows.append(row)
            previous = ids
            print(_fmt(row), flush=True)
            if save is not None:
                save(rows)
    finally:
        serve.shutdown()
        ray.shutdown()
    return rows


HEADER = (f"{'replicas':>8} {'scale-up s':>10} {'verdict s':>9} {'check p50 s':>11} "
          f"{'check max s':>11} {'cpu/check s':>11} {'call p50 s':>10} {'full p50 s':>10} "
          f"{'decide ms':>9} {'mem MiB':>8} {'box busy %':>10}  at rest by role %")


COLUMNS = ["replicas", "scale-up s", "verdict s", "check p50 s", "check max s",
           "cpu/check s", "call p50 s", "full p50 s", "decide ms", "mem MiB", "box busy %",
           "at rest by role %"]


def cells(r: dict[str, Any]) -> list[Any]:
    """One measured row as printed (``HEADER``'s columns), for the result file."""
    return [r["replicas"], f"{r['scale_up_s']:.1f}", f"{r['verdict_after_running_s']:.2f}",
            f"{r['check_s_p50']:.3f}", f"{r['check_s_max']:.3f}", f"{r['check_cpu_s_p50']:.3f}",
            f"{r['call_s_p50']:.3f}", f"{r['full_check_s_p50']:.3f}", f"{r['decide_ms']:.2f}",
            r["memory_mib_over_base"], f"{sum(r['cpu_at_rest_pct'].values()):.1f}",
            ", ".join(f"{k} {v}" for k, v in sorted(r["cpu_at_rest_pct"].items(),
                                                   key=lambda kv: -kv[1]) if v >= 1)]


def _fmt(r: dict[str, Any]) -> str:
    widths = (8, 10, 9, 11, 11, 11, 10, 10, 9, 8, 10)
    row = cells(r)
    return " ".join(f"{v:>{w}}" for v, w in zip(row, widths, strict=False)) + "  " + row[-1]


def record(rows: list[dict[str, Any]], args: argparse.Namespace,
           standin_env: dict[str, str]) -> Path:
    """The rows so far as ``benchmarks/results/controller_scaling.json``."""
    skipped = [r["replicas"] for r in rows if "skipped" in r]
    return write_result(
        "controller_scaling", title="KV-spec controller: time to a verdict vs replica count",
        what=("The real KVSpecController watching N stand-in replicas on one box, scaled up "
              "in place: seconds from all RUNNING to an agreed verdict, one forced check "
              "(p50/max, its CPU, at the caller), a full re-check, decide() alone, the "
              "memory the stand-ins took and the box's CPU at rest by role."),
        command=this_command("benchmarks.controller_scaling"),
        inputs={"counts": args.counts, "period_s": args.period, "repeats": args.repeats,
                "standin_env": standin_env},
        columns=COLUMNS, rows=[cells(r) for r in rows if "skipped" not in r],
        notes=(f"Skipped (would leave under {HEADROOM_MIB} MiB free): {skipped}."
               if skipped else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(DEFAULT_COUNTS), help="replica counts, ascending")
    parser.add_argument("--period", type=float, default=2.0,
                        help="controller_period_s of the controller under test")
    parser.add_argument("--repeats", type=int, default=5, help="forced checks per count")
    parser.add_argument("--standin-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for the stand-in replicas only (e.g. "
                             "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=2000); repeatable")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "controller_scaling.json")
    args = parser.parse_args()
    if args.counts != sorted(args.counts):
        parser.error("--counts must ascend: each step scales the running fleet up")
    bad = [kv for kv in args.standin_env if "=" not in kv]
    if bad:
        parser.error(f"--standin-env {bad[0]!r}: expected KEY=VALUE")
    standin_env = dict(kv.split("=", 1) for kv in args.standin_env)
    # SIGTERM (e.g. from `timeout`) unwinds through measure()'s finally: Serve and Ray stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(HEADER, flush=True)

    def save(rows: list[dict[str, Any]]) -> dict[str, Any]:
        measured = [r for r in rows if "skipped" not in r]
        first, last = measured[0], measured[-1]
        growth = (last["check_s_p50"] / first["check_s_p50"]) if first["check_s_p50"] else None
        result = {
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version()},
            "period_s": args.period,
            "standin_env": standin_env,
            "repeats": args.repeats,
            "rows": rows,
            "check_growth_first_to_last": growth,
            "replica_ratio_first_to_last": last["replicas"] / first["replicas"],
            "decide_ms_at": {n: decide_ms(n) for n in (256, 512)},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        record(rows, args, standin_env)
        return result

    result = save(measure(args.counts, args.period, args.repeats, save, standin_env))
    growth = result["check_growth_first_to_last"]
    if growth is not None:
        print(f"check time x{growth:.1f} for x{result['replica_ratio_first_to_last']:.0f} "
              "replicas")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
