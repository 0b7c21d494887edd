"""Benchmark: two arms booted together, each loaded in turn while the other sits at rest.

Why (issue 34): ``serving_overhead`` runs one arm at a time, so plain vLLM's engine has
the 2-core box to itself while the door's engine shares it with ~0.08 cores of Ray's and
Serve's daemons. That mixes two things: what the door costs each request, and what
resident daemons cost a CPU engine that needs both cores. Here both arms run the whole
time, so every load sees the same processes on the box: the loaded arm's door and
engine, the other arm's idle engine and (for a Ray arm) its idle cluster. The ratio of
the two arms is then the door's own cost; ``serving_overhead``'s ratio minus this one
is what the daemons at rest cost the engine beside them.

Per round: boot both arms (the order alternates), let them settle, then for each arm
(order alternating too) watch it at rest and run the loads against it. Runs are stored
under the arms' own names with ``"beside"`` naming the other, so
``python -m benchmarks.serving_overhead --merge`` prints the usual tables. Heavy: two
engines at once (each ``VLLM_CPU_KVCACHE_SPACE`` 1 GiB):

    for r in 0 1 2; do flock /tmp/dsv4-heavy.lock timeout 1800 python -m \\
        benchmarks.side_by_side --arms mn-haproxy-1,vllm --first-round $r \\
        --loads 1:16:96:32,6:48:96:48 --out results/sbs46/r$r.json; done
    python -m benchmarks.side_by_side --merge results/sbs46/r*.json

While one arm is loaded, the other arm's processes are watched too: their rest on a box
the load keeps busy. The last table prices each arm's path per round over its rest on a
quiet box (as §2h's tables) and over that busy rest (the other arm's load is the same
size), which leaves out what a busy box adds to every periodic loop, tokens or not.

``--alone`` adds a third pass per round: the first arm stopped, the reference arm
loaded again by itself (``<reference>-alone``), so one run has all three.

Writes ``benchmarks/results/side_by_side_<k>.json`` (one per printed table, at a run's end
or its ``--merge``); its next run supersedes the carried-over ``side_by_side_s2*.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks import paced_engine
from benchmarks.arm_procs import cpu_by_role, role_of
from benchmarks.multinode_arms import ENGINE_ROLES, cluster_session, listeners
from benchmarks.overhead_arms import ARMS, REPO, client_port
from benchmarks.overhead_table import merge, tables
from benchmarks.results import this_command, write_tables
from benchmarks.serving_overhead import (
    arm_server,
    parse_loads,
    procs_of,
    run_load,
    settle,
)
from deployments.harness import load as bench_load

# The second arm's ports start here above the first's: a door uses door+1..3 and its
# direct-ingress range from door+10.
PORT_GAP = 100


def load_arm(arm: str, base: str, roots: list[int], loads: list[bench_load.Load],
             tokenizer: str, rest: tuple[float, float, dict[str, float]],
             extra: dict[str, Any], beside_roots: list[int] | None = None
             ) -> list[dict[str, Any]]:
    """Every load once against ``arm`` at ``base`` (``serving_overhead.run_load``), with
    the arm's rest, measured just before, taken off its CPU; and the cores each role of
    the arm beside it used meanwhile (``beside_cores``: its rest on a busy box)."""
    busy, arm_busy, idle = rest
    out = []
    for load in loads:
        other = cpu_by_role(procs_of(beside_roots)) if beside_roots else {}
        res = run_load(arm, load, base, roots, tokenizer, idle)
        if beside_roots:
            after = cpu_by_role(procs_of(beside_roots))
            res["beside_cores"] = {role: max(0.0, after[role] - other.get(role, 0.0))
                                   / res["wall_s"] for role in after}
        res |= extra | {"busy_before_load_pct": busy, "arm_busy_at_rest_pct": arm_busy}
        print(f"[{arm} round {extra['round']}] {res['completed']} ok, {res['failed']} failed, "
              f"{res['output_throughput']:.1f} tok/s, TTFT p50 {res['median_ttft_ms']:.1f} ms, "
              f"TPOT p50 {res['median_tpot_ms']:.2f} ms; box {busy:.0f}% busy before",
              flush=True)
        out.append(res)
    return out


def one_round(arms: list[str], r: int, loads: list[bench_load.Load], tokenizer: str,
              port: int, settle_s: float, idle_s: float,
              runs: dict[str, list[dict[str, Any]]], alone: bool = False,
              extra_env: dict[str, str] | None = None) -> None:
    """Boot both arms (alternating order), then load each in turn (alternating order);
    with ``alone``, stop the first arm and load the reference arm once more by itself
    (recorded as ``<reference>-alone``): what the first arm's processes at rest cost it."""
    ports = {arm: port + i * PORT_GAP for i, arm in enumerate(arms)}
    order = arms if r % 2 == 0 else list(reversed(arms))
    logs = {a: REPO / "results" / "logs" / f"side_by_side-{a}-{r}.log" for a in arms}
    with contextlib.ExitStack() as ref_stack, contextlib.ExitStack() as first_stack:
        stacks = {arms[0]: first_stack, arms[1]: ref_stack}
        booted = {}
        for arm in order:
            boot_s, root = stacks[arm].enter_context(
                arm_server(arm, ports[arm], 1, logs[arm], boot_timeout_s=600,
                           extra_env=extra_env))
            booted[arm] = (boot_s, [root, *([s] if (s := cluster_session(logs[arm])) else [])])
        for arm in order:
            other = next(a for a in arms if a != arm)
            runs[arm] += measured(arm, ports[arm], booted[arm], r, other, loads, tokenizer,
                                  settle_s, idle_s, booted[other][1])
        if alone:
            first_stack.close()  # the first arm stops; the reference arm stays up
            ref = arms[1]
            runs.setdefault(f"{ref}-alone", []).extend(
                measured(ref, ports[ref], booted[ref], r, None, loads, tokenizer,
                         settle_s, idle_s))


def measured(arm: str, port: int, booted: tuple[float, list[int]], r: int,
             beside: str | None, loads: list[bench_load.Load], tokenizer: str,
             settle_s: float, idle_s: float, beside_roots: list[int] | None = None
             ) -> list[dict[str, Any]]:
    """Settle, watch ``arm`` at rest, then run the loads against it (and watch the arm
    beside it, ``beside_roots``, while they run)."""
    boot_s, roots = booted
    rest = settle(settle_s, idle_s, functools.partial(procs_of, roots))
    extra = {"round": r, "boot_s": round(boot_s, 1), "beside": beside,
             "listeners": listeners(procs_of(roots), role_of)}
    base = f"http://127.0.0.1:{client_port(arm, port)}"
    return load_arm(arm, base, roots, loads, tokenizer, rest, extra, beside_roots)


def goals(runs: dict[str, list[dict[str, Any]]], arm: str, other: str) -> str:
    """Per load, the per-round paired TTFT difference, TPOT ratio and throughput ratio of
    ``arm`` over ``other``: median (min-max)."""
    lines = [f"| load | TTFT p50 {arm} - {other}, ms | TPOT p50 ratio | out tok/s ratio |",
             "|---|---|---|---|"]
    labels = dict.fromkeys(r["load"] for r in runs.get(arm, []))
    for label in labels:
        mine = {r["round"]: r for r in runs[arm] if r["load"] == label}
        theirs = {r["round"]: r for r in runs.get(other, []) if r["load"] == label}
        common = sorted(mine.keys() & theirs.keys())
        if not common:
            continue

        def cell(values: list[float], fmt: str) -> str:
            return (f"{statistics.median(values):{fmt}} ({min(values):{fmt}} to "
                    f"{max(values):{fmt}})")

        ttft = [mine[k]["median_ttft_ms"] - theirs[k]["median_ttft_ms"] for k in common]
        tpot = [mine[k]["median_tpot_ms"] / theirs[k]["median_tpot_ms"] for k in common]
        tput = [mine[k]["output_throughput"] / theirs[k]["output_throughput"] for k in common]
        lines.append(f"| {label} ({len(common)} rounds) | {cell(ttft, '+.1f')} | "
                     f"{cell(tpot, '.3f')} | {cell(tput, '.3f')} |")
    return "\n".join(lines)


def contended_marginal(run: dict[str, Any], rest_cores: dict[str, float]
                       ) -> dict[str, float]:
    """Per role, CPU-ms per output token over ``run``'s load minus the role's cores while
    the other arm's load kept the box as busy (``rest_cores``): what the tokens cost, apart
    from loops that run whether tokens flow or not, each loop priced on a busy box."""
    tokens = max(round(run["output_throughput"] * run["duration"]), 1)
    return {role: v["ms_per_tok"] - 1000 * rest_cores.get(role, 0.0) * run["wall_s"] / tokens
            for role, v in run["cpu"].items() if role not in ENGINE_ROLES}


def quiet_marginal(run: dict[str, Any]) -> dict[str, float]:
    """Per role, the marginal CPU-ms per token over the role's rest on a quiet box."""
    return {role: v["marginal_ms_per_tok"] for role, v in run["cpu"].items()
            if role not in ENGINE_ROLES and "marginal_ms_per_tok" in v}


def path_ratios(runs: dict[str, list[dict[str, Any]]], arm: str, other: str) -> str:
    """Per load and rest, the serving path's CPU per token of both arms, per round paired:
    the medians of each path, the median (min-max) of the per-round ratios, and the roles
    of ``arm`` whose median is 0.005 ms or more. Over the rest on a quiet box
    (``quiet_marginal``, what §2h's tables show) and on a busy one (``contended_marginal``)."""
    lines = [f"| load | rest | path {arm}, ms/token | path {other}, ms/token | "
             f"ratio per round | {arm}'s roles, ms/token |", "|---|---|---|---|---|---|"]
    for label in dict.fromkeys(r["load"] for r in runs.get(arm, [])):
        mine = {r["round"]: r for r in runs[arm] if r["load"] == label and "wall_s" in r}
        theirs = {r["round"]: r for r in runs.get(other, [])
                  if r["load"] == label and "wall_s" in r}
        common = sorted(k for k in mine.keys() & theirs.keys()
                        if "beside_cores" in mine[k] and "beside_cores" in theirs[k])
        if not common:
            continue
        views = {
            "quiet": ([quiet_marginal(mine[k]) for k in common],
                      [quiet_marginal(theirs[k]) for k in common]),
            "busy": ([contended_marginal(mine[k], theirs[k]["beside_cores"]) for k in common],
                     [contended_marginal(theirs[k], mine[k]["beside_cores"]) for k in common]),
        }
        for rest, (a, b) in views.items():
            lines.append(f"| {label} ({len(common)} rounds) | {rest} | {_paired(a, b)} |")
    return "\n".join(lines)


def _paired(a: list[dict[str, float]], b: list[dict[str, float]]) -> str:
    """Table cells for one rest: both paths' medians, the per-round ratio, ``a``'s roles."""
    pa, pb = [sum(x.values()) for x in a], [sum(x.values()) for x in b]
    ratio = [x / y for x, y in zip(pa, pb, strict=True) if y > 0]
    roles = {role: statistics.median(x.get(role, 0.0) for x in a)
             for role in sorted({r for x in a for r in x})}
    top = ", ".join(f"{role} {v:.3f}" for role, v in
                    sorted(roles.items(), key=lambda kv: -kv[1]) if abs(v) >= 0.005)
    cell = (f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})"
            if ratio else "-")
    return (f"{statistics.median(pa):.3f} | {statistics.median(pb):.3f} | {cell} | {top}")


def all_goals(runs: dict[str, list[dict[str, Any]]], arms: list[str]) -> str:
    """The first arm against the reference beside it and, when measured, the reference
    beside the first arm against itself alone, and the first arm against that."""
    pairs = [(arms[0], arms[1])]
    if f"{arms[1]}-alone" in runs:
        pairs += [(arms[1], f"{arms[1]}-alone"), (arms[0], f"{arms[1]}-alone")]
    return "\n\n".join([*(goals(runs, a, o) for a, o in pairs),
                        path_ratios(runs, arms[0], arms[1])])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="mn-haproxy-1,vllm",
                        help=f"two, comma-separated, from {ARMS}; the second is the reference")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--first-round", type=int, default=0)
    parser.add_argument("--loads", default="1:16:96:32,6:48:96:48")
    parser.add_argument("--port", type=int, default=8017)
    parser.add_argument("--settle-s", type=float, default=15.0)
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--alone", action="store_true",
                        help="then stop the first arm and load the second once more by itself")
    parser.add_argument("--paced", default="", metavar="TOK_S:PER_CHUNK",
                        help="both engines emit tokens at this rate (benchmarks.paced_engine)")
    parser.add_argument("--merge", type=Path, nargs="+",
                        help="no run: print the tables over these result files' runs")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "side_by_side.json")
    args = parser.parse_args()
    arms = args.arms.split(",")
    if len(arms) != 2 or len(set(arms)) != 2 or not set(arms) <= set(ARMS):
        parser.error(f"--arms={args.arms!r}: expected two different arms from {ARMS}")
    if args.merge:
        merged = merge(args.merge)
        printed = tables(merged) + "\n\n" + all_goals(merged, arms)
        print(printed)
        record(printed, arms, loads=None, paced=args.paced)
        return 0
    try:
        loads = parse_loads(args.loads)
        paced = paced_engine.paced_env(*paced_engine.parse(args.paced)) if args.paced else {}
    except ValueError as exc:
        parser.error(str(exc))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # arm_server's finally stops both
    from dsv4_patch.tiny_model import ensure_tiny_model

    tokenizer = str(ensure_tiny_model())
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for r in range(args.first_round, args.first_round + args.rounds):
        one_round(arms, r, loads, tokenizer, args.port, args.settle_s, args.idle_s, runs,
                  args.alone, paced)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"runs": runs, "arms": arms}, indent=2))
    printed = tables(runs) + "\n\n" + all_goals(runs, arms)
    print(printed)
    print(f"wrote {args.out}")
    record(printed, arms, loads=args.loads, paced=args.paced)
    return 0


def record(printed: str, arms: list[str], loads: str | None, paced: str) -> list[Path]:
    """The printed tables as ``benchmarks/results/side_by_side[_k].json`` (one file per
    table); a run over several jobs writes them at its ``--merge``."""
    paths = write_tables(
        "side_by_side", printed, title=f"Side by side: {arms[0]} beside {arms[1]}",
        what=("Two arms booted together, each loaded in turn while the other sits at rest: "
              "throughput, latency and CPU by process per load, the ratio of the two arms "
              "(the door's own cost with the same processes on the box), and each arm's "
              "path priced over its quiet and its busy rest."),
        command=this_command("benchmarks.side_by_side"),
        inputs={"arms": arms, "loads": loads or "as in the merged runs", "paced": paced or None})
    for path in paths:
        print(f"wrote {path}")
    return paths


if __name__ == "__main__":
    sys.exit(main())
