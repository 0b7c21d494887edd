"""Benchmark: where a request's time and CPU go, hop by hop, in one serving arm.

Boots one arm of ``benchmarks.serving_overhead`` (the same processes, engine and
config), then measures three things, one phase at a time so they do not disturb
each other:

1. **Per-hop latency** of sequential one-token completions: the client's own wall
   time, and each Serve component's access-log time for the same request id
   (``proxy`` ... ``POST /v1/completions 200 12.3ms``, then the server replica's
   line: since issue 16 it is the HTTP ingress itself, so ours has two hops where
   it had three). A hop's cost is its time minus the time of the hop it waits on.
2. **CPU seconds per process** while ``vllm bench serve`` runs (``psutil``, every
   process of the arm's session, grouped by role, ``benchmarks.arm_procs``: proxy,
   stock's ingress replica, server replica, engine core and worker, controllers, Ray
   system). On 2 cores, CPU a relay process burns is CPU the engine does not get.
3. **A profile** of the relay processes under the same load (``py-spy record``,
   raw collapsed stacks, sampling at a low rate, ``--nonblocking``): per process the
   samples on CPU and the functions most often on the stack (inclusive), project
   and library frames only (the event-loop and thread plumbing above them dropped).

Heavy: ``flock /tmp/dsv4-heavy.lock timeout 600 python -m benchmarks.hop_profile --arm ours``.

``--table`` writes ``benchmarks/results/hop_profile_<k>.json`` (one per printed table); its
next run supersedes the carried-over ``hop_profile_s2*.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psutil

from benchmarks import serving_overhead as so
from benchmarks.arm_procs import cpu_by_role, cpu_by_thread, python_threads, role_of
from benchmarks.overhead_arms import client_env, client_port
from benchmarks.results import this_command, write_tables
from deployments.harness import load as bench_load

_ACCESS = re.compile(r"^\w+ \S+ \S+ (?P<who>\S+) \S+ (?P<rid>[0-9a-f-]{36}) -- "
                     r"(?P<what>.+?) (?P<ms>[\d.]+)ms$")


def serve_log_dir(procs: list[psutil.Process]) -> Path | None:
    for proc in procs:
        try:
            match = re.search(r"--session[-_]dir=(\S+)", " ".join(proc.cmdline()))
        except psutil.NoSuchProcess:
            continue
        if match:
            return Path(match.group(1)) / "logs" / "serve"
    return None


def one_token(base: str, request_id: str) -> float:
    body = json.dumps({"model": so.MODEL_ID, "prompt": "hello there", "max_tokens": 1}).encode()
    key = os.environ.get("OPENAI_API_KEY")  # keyed arms: set from client_env in main
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={
        "Content-Type": "application/json", "x-request-id": request_id}
        | ({"Authorization": f"Bearer {key}"} if key else {}))
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()
    return (time.perf_counter() - started) * 1000


def access_times(log_dir: Path | None, ids: set[str]) -> dict[str, list[float]]:
    """Per component, the access-log milliseconds of the given request ids."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    if log_dir is None or not log_dir.is_dir():
        return out
    # Server replicas' access lines land in their worker's stderr (vLLM reconfigures
    # logging in that process), not in logs/serve/.
    for path in [*log_dir.glob("*.log"), *log_dir.parent.glob("worker-*.err")]:
        for line in path.read_text(errors="replace").splitlines():
            m = _ACCESS.match(line)
            if m and m["rid"] in ids and ("POST" in m["what"] or "CALL" in m["what"]):
                who = m["who"].split("_", 1)[-1] if m["who"] != "proxy" else "proxy"
                out[who].append(float(m["ms"]))
    return out


def py_spy(pids: dict[str, int], seconds: int, out_dir: Path,
           rate: int = 25) -> dict[str, list[tuple[str, int]]]:
    """Top self-time frames per process from ``py-spy record --format raw``, sampling
    ``rate`` times a second (low by default: the sampler takes CPU from the engine)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    procs = {}
    for role, pid in pids.items():
        out = out_dir / f"pyspy-{role}.txt"
        procs[role] = (subprocess.Popen(
            [exe, "record", "-p", str(pid), "-d", str(seconds), "-r", str(rate), "--nonblocking",
             "-f", "raw", "-o", str(out)], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL), out)
    tops = {}
    for role, (proc, out) in procs.items():
        proc.wait(timeout=seconds + 60)
        tops[role] = top_frames(out.read_text() if out.exists() else "")
    return tops


# Frames that sit on every stack of a busy Ray worker: plumbing, not cost.
_PLUMBING = re.compile(r"\((threading|worker|thread|base_events|events|runners|"
                       r"selectors|asyncio|tasks|futures|replica|router)\.py\)")


def top_frames(raw: str, n: int = 15) -> list[tuple[str, int]]:
    """(function, samples on the stack) for the ``n`` commonest, plus the total."""
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        for frame in {_frame(f) for f in stack.split(";")}:
            if not _PLUMBING.search(frame):
                inclusive[frame] += int(count)
    return [("TOTAL samples", total), *inclusive.most_common(n)]


def _frame(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)"
    m = re.match(r"(?P<fn>.*?) \((?P<path>[^:)]+)", frame)
    return f"{m['fn']} ({Path(m['path']).name})" if m else frame


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", choices=so.ARMS, default="ours")
    parser.add_argument("--port", type=int, default=8019)
    parser.add_argument("--singles", type=int, default=30)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--profile-s", type=int, default=15, help="0: no py-spy phase")
    parser.add_argument("--threads", action="store_true",
                        help="also CPU per thread (at rest: cores; under a load: ms per token)")
    parser.add_argument("--spy-rate", type=int, default=25, help="py-spy samples per second")
    parser.add_argument("--loads", default="",
                        help="CPU per request and per token under these loads, one boot: "
                             "comma-separated CONCURRENCY:PROMPTS:IN:OUT (issue 25: "
                             "1:16:96:32,6:48:96:48); replaces the single --concurrency load; "
                             "none: no load (idle and one-token only)")
    parser.add_argument("--idle-s", type=float, default=0,
                        help="before any load: CPU by role over this many seconds at rest")
    parser.add_argument("--out", type=Path, default=so.REPO / "results" / "hop_profile")
    parser.add_argument("--table", type=Path, nargs="+",
                        help="no run: markdown tables of these result files (arms side by side)")
    args = parser.parse_args()
    if args.table:
        printed = tables([json.loads(p.read_text()) for p in args.table])
        print(printed)
        record(printed, [str(p) for p in args.table])
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    from dsv4_patch.tiny_model import ensure_tiny_model

    # Keyed arms (the door demands a key): the singles and `vllm bench serve` send it.
    os.environ.update(client_env(args.arm))
    tokenizer = str(ensure_tiny_model())
    base = f"http://127.0.0.1:{client_port(args.arm, args.port)}"
    load = bench_load.Load(num_prompts=args.num_prompts, concurrency=args.concurrency,
                           input_len=args.input_len, output_len=args.output_len)
    result: dict[str, Any] = {"arm": args.arm, "load": load.__dict__}
    log = args.out / f"{args.arm}.log"
    with so.arm_server(args.arm, args.port, 1, log, boot_timeout_s=600) as (boot_s, root):
        # the arm's session and, for the --nodes arms, its local cluster's
        roots = [root, *([c] if (c := so.cluster_session(log)) else [])]
        result["boot_s"] = round(boot_s, 1)
        procs = so.procs_of(roots)
        names = python_names(roots) if args.threads else None
        ids = {str(uuid.uuid4()) for _ in range(args.singles)}
        client = [one_token(base, rid) for rid in sorted(ids)]
        time.sleep(2)  # access logs are flushed asynchronously
        hops = access_times(serve_log_dir(procs), ids)
        result["one_token_ms"] = {"client": _stats(client)} | {
            who: _stats(ms) for who, ms in hops.items()}
        if args.idle_s:
            result["idle"] = idle_by_role(roots, args.idle_s, names)
        if args.loads == "none":
            result["per_load"] = []
        elif args.loads:
            result["per_load"] = [cpu_per_load(parse_load(spec), base, tokenizer, roots, names)
                                  for spec in args.loads.split(",")]
        else:
            one = cpu_per_load(load, base, tokenizer, roots, names)
            result["load"], result["cpu_s_under_load"] = one["result"], one["cpu_s"]
            result["load_wall_s"] = one["wall_s"]
        if not args.profile_s:
            path = args.out / f"{args.arm}.json"
            path.write_text(json.dumps(result, indent=2))
            print(json.dumps(result, indent=2))
            print(f"wrote {path}")
            return 0
        pids = _relay_pids(so.procs_of(roots))
        spy: dict[str, Any] = {}
        loader = threading.Thread(target=lambda: spy.update(
            py_spy(pids, args.profile_s, args.out, args.spy_rate)))
        loader.start()
        bench_load.run(bench_load.Load(num_prompts=args.num_prompts, concurrency=args.concurrency,
                                       input_len=args.input_len, output_len=args.output_len,
                                       seed=1), base, so.MODEL_ID, tokenizer)
        loader.join()
        result["py_spy_top_self"] = spy
    path = args.out / f"{args.arm}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "py_spy_top_self"}, indent=2))
    for role, top in result["py_spy_top_self"].items():
        print(f"--- py-spy {role}")
        for frame, count in top:
            print(f"{count:6d}  {frame}")
    print(f"wrote {path}")
    return 0


def parse_load(spec: str) -> bench_load.Load:
    """``CONCURRENCY:PROMPTS:IN:OUT`` -> a load."""
    conc, prompts, inp, out = (int(x) for x in spec.split(":"))
    return bench_load.Load(num_prompts=prompts, concurrency=conc, input_len=inp, output_len=out)


def thread_delta(before: dict[str, float], after: dict[str, float], per: float,
                 names: dict[int, str]) -> dict[str, float]:
    """Each thread's CPU between two ``cpu_by_thread`` snapshots divided by ``per``
    (seconds: cores; tokens: seconds per token), Python thread names added; threads
    that used under one clock tick left out."""
    out = {}
    for key, cpu in after.items():
        used = cpu - before.get(key, 0.0)
        if used >= 0.01:
            tid = int(key.split()[2])
            out[f"{key} {names[tid]}" if tid in names else key] = round(used / per, 6)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def python_names(roots: list[int]) -> dict[int, str]:
    """OS thread id -> Python thread name in the arm's Python serving processes."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    names: dict[int, str] = {}
    for proc in so.procs_of(roots):
        if role_of(proc) in ("server", "vllm-api", "controller", "proxy"):
            dump = subprocess.run([exe, "dump", "-p", str(proc.pid), "--nonblocking"],
                                  capture_output=True, text=True, timeout=60, check=False)
            if dump.returncode:  # the threads keep their kernel names; say why
                print(f"py-spy dump -p {proc.pid} failed ({dump.returncode}): "
                      f"{dump.stderr.strip()[:300]}", file=sys.stderr)
            names |= python_threads(dump.stdout)
    return names


def snapshot(roots: list[int], threads: bool) -> tuple[dict[str, float], dict[str, float]]:
    """CPU so far by role, and by thread when ``threads`` (else empty), from one scan of
    the arm's processes."""
    procs = so.procs_of(roots)
    return cpu_by_role(procs), cpu_by_thread(procs) if threads else {}


def cpu_per_load(load: bench_load.Load, base: str, tokenizer: str,
                 roots: list[int], names: dict[int, str] | None = None) -> dict[str, Any]:
    """Run ``load`` once; CPU seconds per role over it, and per request / per output
    token in milliseconds: the role's CPU over the whole call divided by what the call
    served (``vllm bench serve`` runs its warm-up requests inside the call, so they
    count as requests and tokens too)."""
    before, threads_before = snapshot(roots, names is not None)
    started = time.monotonic()
    res = bench_load.summary(bench_load.run(load, base, so.MODEL_ID, tokenizer))
    wall = time.monotonic() - started
    after, threads_after = snapshot(roots, names is not None)
    cpu = {r: round(after.get(r, 0) - before.get(r, 0), 2)
           for r in sorted(set(after) | set(before))}
    requests = load.num_prompts + load.warmups
    tokens = load.num_prompts * load.output_len + load.warmups * load.output_len
    return {"load": load.__dict__, "result": res, "wall_s": round(wall, 1), "cpu_s": cpu,
            "box_busy_pct": round(100 * sum(cpu.values()) / (wall * (psutil.cpu_count() or 1)), 1),
            "cpu_ms_per_request": {r: round(1000 * v / requests, 1) for r, v in cpu.items()},
            "cpu_ms_per_token": {r: round(1000 * v / tokens, 2) for r, v in cpu.items()},
            "share_of_wall_pct": {r: round(100 * v / wall, 1) for r, v in cpu.items()},
            **({"thread_cpu_ms_per_token": {k: round(1000 * v, 4) for k, v in thread_delta(
                threads_before, threads_after, tokens, names).items()}}
               if names is not None else {})}


def idle_by_role(roots: list[int], seconds: float,
                 names: dict[int, str] | None = None) -> dict[str, Any]:
    """The arm at rest: each role's share of one core over ``seconds``, and the box's;
    with ``names``, each thread's too."""
    before, threads_before = snapshot(roots, names is not None)
    box = psutil.cpu_percent(interval=seconds)
    after, threads_after = snapshot(roots, names is not None)
    threads = ({"thread_cores": thread_delta(threads_before, threads_after, seconds, names)}
               if names is not None else {})
    return threads | {"seconds": seconds, "box_busy_pct": box,
            "arm_pct_of_box": round(100 * sum(after.get(r, 0) - before.get(r, 0) for r in after)
                                    / (seconds * (psutil.cpu_count() or 1)), 2),
            "pct_of_one_core": {r: round(100 * (after.get(r, 0) - before.get(r, 0)) / seconds, 2)
                                for r in sorted(set(after) | set(before))}}


def tables(results: list[dict[str, Any]]) -> str:
    """Per load: each role's CPU ms per request and per output token, arms side by side;
    then each role's share of one core at rest."""
    out = []
    loads = {json.dumps(pl["load"], sort_keys=True): pl["load"]
             for r in results for pl in r.get("per_load", [])}
    for key, load in loads.items():
        per = {r["arm"]: pl for r in results for pl in r.get("per_load", [])
               if json.dumps(pl["load"], sort_keys=True) == key}
        arms = list(per)
        roles = sorted({role for pl in per.values() for role in pl["cpu_s"]})
        out.append(f"**c={load['concurrency']}, {load['num_prompts']} prompts, "
                   f"{load['input_len']} in / {load['output_len']} out** -- CPU ms per request "
                   "/ per output token (warm-ups counted)\n")
        out.append("| process | " + " | ".join(arms) + " |")
        out.append("|---" * (1 + len(arms)) + "|")
        for role in roles:
            cells = [f"{per[a]['cpu_ms_per_request'].get(role, 0):.1f} / "
                     f"{per[a]['cpu_ms_per_token'].get(role, 0):.2f}"
                     if role in per[a]["cpu_s"] else "-" for a in arms]
            out.append(f"| {role} | " + " | ".join(cells) + " |")
        out.append("| (wall s; arm's share of the box %) | " + " | ".join(
            f"{per[a]['wall_s']}; {per[a]['box_busy_pct']}" for a in arms) + " |")
        out.append("| (out tok/s, TTFT p50 ms, TPOT p50 ms) | " + " | ".join(
            f"{per[a]['result']['output_throughput']:.1f}, "
            f"{per[a]['result']['median_ttft_ms']:.0f}, {per[a]['result']['median_tpot_ms']:.1f}"
            for a in arms) + " |")
        out.append("")
    idle = {r["arm"]: r["idle"] for r in results if "idle" in r}
    if idle:
        arms = list(idle)
        roles = sorted({role for i in idle.values() for role in i["pct_of_one_core"]})
        out.append("**At rest** -- % of one core over the window\n")
        out.append("| process | " + " | ".join(arms) + " |")
        out.append("|---" * (1 + len(arms)) + "|")
        for role in roles:
            out.append(f"| {role} | " + " | ".join(
                f"{idle[a]['pct_of_one_core'].get(role, 0):.2f}" for a in arms) + " |")
        out.append("| **the arm, % of the box** | " + " | ".join(
            f"**{idle[a]['arm_pct_of_box']:.2f}**" for a in arms) + " |")
        out.append("| (the whole box, % busy: other jobs too) | " + " | ".join(
            f"{idle[a]['box_busy_pct']:.0f}" for a in arms) + " |")
    hops = {r["arm"]: r.get("one_token_ms", {}) for r in results}
    if any(hops.values()):
        out.append("\n**One-token completion, p50 ms (client; each access log)**\n")
        for arm, h in hops.items():
            out.append(f"- {arm}: " + ", ".join(f"{who} {v.get('p50')}" for who, v in h.items()))
    return "\n".join(out)


def _relay_pids(procs: list[psutil.Process]) -> dict[str, int]:
    pids = {}
    for proc in procs:
        role = role_of(proc)
        if role in ("proxy", "ingress", "server", "vllm-api") and role not in pids:
            pids[role] = proc.pid
    return pids


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"n": len(values), "p50": round(statistics.median(values), 1),
            "min": round(min(values), 1), "max": round(max(values), 1)}


def record(printed: str, files: list[str]) -> list[Path]:
    """``--table``'s tables as ``benchmarks/results/hop_profile[_k].json`` (one file per
    table); the one-token latencies it lists go in the notes."""
    hops = "\n".join(line for line in printed.splitlines() if line.startswith("- "))
    paths = write_tables(
        "hop_profile", printed, title="Hop profile: CPU by process, arms side by side",
        what=("Each role's CPU ms per request and per output token under each load, arms "
              "side by side (one boot per arm), then each role's share of one core at rest."),
        command=this_command("benchmarks.hop_profile"), inputs={"arm_results": files},
        notes=f"One-token completion, p50 ms (client; each access log):\n{hops}" if hops
        else "")
    for path in paths:
        print(f"wrote {path}")
    return paths


if __name__ == "__main__":
    raise SystemExit(main())
