"""Session affinity and KV-pressure autoscaling on the local 2-node autoscaled cluster.

``python -m benchmarks.session_routing`` (heavy: run under the shared lock). Two parts,
each on its own ``dsv4-serve run configs/local-cpu.yaml --nodes 2`` through Serve's
proxy (the door whose router is ours, ``serving.router.KVSpecRouter``):

* **sessions** -- 2 replicas (min = max = 2). A multi-turn workload: every request is a
  shared system prompt, then its session's context, which grows by more than 256 tokens
  each turn (DeepSeek-V4's prefix-cache hit step), then a question; streamed, a few
  output tokens. Arms interleaved per round (order alternating): ``today`` (no session
  header: power of two among the undrained) and ``affinity`` (``x-session-id``). Per arm:
  TTFT p50/p95 per turn (client-side, first streamed chunk), requests per replica and
  vLLM's prefix-cache hits/queries per replica (Ray's metrics endpoint, read one export
  interval after the arm's last request).
* **step** -- 1 replica (min 1, max 2), then a load step (``--step-concurrency``
  streams of long completions): seconds from the step to 2 replicas answering the
  KV-spec check, for ``kv_pressure`` (ours) and ``serve_default`` (Serve's
  ongoing-requests policy, ``target_ongoing_requests`` 4, its 30 s upscale delay).

On an x86 host without AMX vLLM turns DeepSeek-V4's prefix caching off
(``vllm/platforms/cpu.py``): hits/queries are then 0/0, and affinity cannot change TTFT
through the cache; the result's ``notes`` say which it was.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.results import host, this_command, write_result

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "local-cpu.yaml"
PORT = 8620
SERVING_LINE = "Serving; Ctrl-C to stop."
_METRICS = re.compile(r"Prometheus metrics: (\S+)")
MODEL = "dsv4-tiny"
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()


def words(n: int, seed: str) -> str:
    """``n`` words, different per ``seed`` (a context no other session shares)."""
    h = abs(hash(seed)) % len(WORDS)
    return " ".join(f"{WORDS[(h + i * 7) % len(WORDS)]}{(i * 31 + h) % 97}" for i in range(n))


def config(replicas: tuple[int, int], policy: str) -> dict[str, Any]:
    """``configs/local-cpu.yaml`` behind Serve's proxy on ``PORT``, autoscaling bounds."""
    raw = copy.deepcopy(yaml.safe_load(CONFIG.read_text()))
    raw["http_options"]["port"] = PORT
    args = raw["applications"][0]["args"]
    args["http"].pop("replica_port", None)
    low, high = replicas
    args["llm"]["deployment_config"]["autoscaling_config"] = {
        "min_replicas": low, "initial_replicas": low, "max_replicas": high,
        "target_ongoing_requests": 4}
    args["dsv4"]["autoscaling"] = {"policy": policy}
    return raw


class Run:
    """One ``dsv4-serve run ... --nodes 2``, stopped by SIGINT to its process group."""

    def __init__(self, cfg: dict[str, Any], workdir: Path, name: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.log = workdir / f"{name}.log"
        exe = str(Path(sys.executable).with_name("dsv4-serve"))
        self.proc = subprocess.Popen(
            [exe, "run", str(path), "--nodes", "2", "--no-smoke", "--node-idle-timeout-s",
             "600"], stdout=self.log.open("w"), stderr=subprocess.STDOUT,
            start_new_session=True, env=os.environ.copy())
        self.url = f"http://127.0.0.1:{PORT}/v1"

    def wait(self, timeout_s: float = 600) -> str:
        """Until serving; Ray's metrics URL."""
        end = time.monotonic() + timeout_s
        while SERVING_LINE not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"dsv4-serve run not serving; log {self.log}")
            time.sleep(2)
        match = _METRICS.search(self.log.read_text(errors="replace"))
        assert match, self.log
        return match.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


def ttft(http: httpx.Client, url: str, prompt: str, session: str | None) -> tuple[float, int]:
    """Seconds to the first streamed chunk of a completion, and its prompt tokens (the
    stream's usage chunk: the turns must cross DeepSeek-V4's 256-token hit step)."""
    headers = {"x-session-id": session} if session else {}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, tokens = float("nan"), 0
    with http.stream("POST", f"{url}/completions", json=body, headers=headers) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first != first:  # nan: the first chunk
                first = time.perf_counter() - start
            usage = json.loads(line[6:]).get("usage") or {}
            tokens = int(usage.get("prompt_tokens", tokens))
    return first, tokens


def prefix_caching(metrics_url: str) -> str:
    """What vLLM decided about prefix caching on this run: its ``cache_config_info``
    gauge's label, else the line vLLM logs when it turns it off (x86 without AMX)."""
    for name, rows in every_node(metrics_url).items():
        for labels, _ in rows if "cache_config_info" in name else []:
            if "enable_prefix_caching" in labels:
                return f"{labels['enable_prefix_caching']} (vLLM's {name})"
    logs = Path("/tmp/ray/session_latest/logs")
    for path in logs.glob("worker-*") if logs.exists() else []:
        if "prefix caching to be disabled" in path.read_text(errors="replace"):
            return f"False (vLLM logged it turns prefix caching off: {path.name})"
    return "unknown"


def every_node(head_url: str) -> dict[str, list[Any]]:
    """The samples of every node's metrics endpoint (each raylet of the local cluster has
    its own, named in the session's ``metrics_export_port_<node>`` files; a replica's
    series are on its node's), the head's included."""
    from deployments.observe import scrape

    session = Path("/tmp/ray/session_latest")
    urls = {head_url} | {f"http://127.0.0.1:{f.read_text().strip()}/metrics"
                         for f in session.glob("metrics_export_port_*")}
    out: dict[str, list[Any]] = {}
    for url in sorted(urls):
        try:
            text = scrape.read(url)
        except OSError:  # a node removed since
            continue
        for name, rows in scrape.samples(text).items():
            out.setdefault(name, []).extend(rows)
    return out


def per_replica(metrics_url: str) -> dict[str, dict[str, float]]:
    """Per replica id: delivered requests, prefix-cache hits and queries (totals)."""
    samples = every_node(metrics_url)
    out: dict[str, dict[str, float]] = {}
    for name, key, label in (
            ("ray_dsv4_serve_time_to_first_token_seconds_count", "requests", "replica"),
            ("ray_vllm_prefix_cache_hits", "hits", "ReplicaId"),  # vllm:prefix_cache_hits
            ("ray_vllm_prefix_cache_queries", "queries", "ReplicaId")):
        for labels, value in samples.get(name, []) + samples.get(f"{name}_total", []):
            rid = labels.get(label, "")
            out.setdefault(rid, {}).setdefault(key, 0.0)
            out[rid][key] += value
    return out


def delta(after: dict[str, dict[str, float]],
          before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {rid: {k: v - before.get(rid, {}).get(k, 0.0) for k, v in vals.items()}
            for rid, vals in after.items()}


def sessions_part(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    run = Run(config((2, 2), "kv_pressure"), workdir, "sessions")
    try:
        metrics_url = run.wait()
        system = words(args.system_words, "system")
        ttfts: dict[str, dict[int, list[float]]] = {"today": {}, "affinity": {}}
        tokens: dict[int, list[int]] = {}
        replicas: dict[str, list[dict[str, dict[str, float]]]] = {"today": [], "affinity": []}
        figures = {"ttft": ttfts, "replicas": replicas, "prompt_tokens": tokens,
                   "prefix_caching": prefix_caching(metrics_url), "date": _now(), "rounds": 0}
        with httpx.Client(timeout=300) as http:
            ttft(http, run.url, "warm up", None)
            ttft(http, run.url, "warm up", "warm")
            time.sleep(11)  # Ray's export interval: a scrape holds everything before it
            before = per_replica(metrics_url)
            for rnd in range(args.rounds):
                for arm in (("today", "affinity") if rnd % 2 == 0 else ("affinity", "today")):
                    contexts = {s: "" for s in range(args.sessions)}
                    for turn in range(args.turns):
                        for s in contexts:
                            contexts[s] += " " + words(args.turn_words, f"{arm}{rnd}{s}{turn}")
                            prompt = f"{system}\n{contexts[s]}\nQuestion {turn}:"
                            key = f"{arm}-{rnd}-{s}" if arm == "affinity" else None
                            first, used = ttft(http, run.url, prompt, key)
                            ttfts[arm].setdefault(turn + 1, []).append(first)
                            tokens.setdefault(turn + 1, []).append(used)
                    time.sleep(11)
                    after = per_replica(metrics_url)
                    replicas[arm].append(delta(after, before))
                    before = after
                figures["rounds"] = rnd + 1
                save(workdir, "sessions", figures)  # a run cut short keeps its rounds
        return figures
    finally:
        run.stop()


def step_part(args: argparse.Namespace, workdir: Path, policy: str) -> dict[str, Any]:
    """Seconds from a load step to 2 replicas answering, under ``policy``."""
    run = Run(config((1, 2), policy), workdir, f"step-{policy}")
    stop = threading.Event()
    try:
        run.wait()
        prompt = words(300, "step")

        def stream() -> None:
            with httpx.Client(timeout=300) as http:
                while not stop.is_set():
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 300,
                            "stream": True, "ignore_eos": True}
                    try:
                        with http.stream("POST", f"{run.url}/completions", json=body) as r:
                            for _ in r.iter_lines():
                                if stop.is_set():
                                    break
                    except httpx.HTTPError:
                        time.sleep(0.5)

        threads = [threading.Thread(target=stream, daemon=True)
                   for _ in range(args.step_concurrency)]
        start, step_epoch = time.monotonic(), time.time()
        for t in threads:
            t.start()
        serving_s = None
        while time.monotonic() - start < args.step_timeout_s:
            try:
                with urllib.request.urlopen(f"{run.url}/kv-spec?refresh=true", timeout=10) as r:
                    rep = json.loads(r.read())
                if rep.get("answered", 0) >= 2:
                    serving_s = time.monotonic() - start
                    break
            except OSError:
                pass
            time.sleep(2)
        log = decisions()
        return {"policy": policy, "step_epoch_s": step_epoch, "date": _now(),
                "seconds_to_decision": upscaled_at(log, step_epoch),
                "seconds_to_second_replica": serving_s, "controller_log": log}
    finally:
        stop.set()
        run.stop()


def decisions() -> list[str]:
    """Serve controller log lines about scaling (``Upscaling``/``Downscaling``, under
    either policy) of the newest local Ray session (ours), and the ``dsv4: autoscale``
    lines the policy logs from the controller's worker."""
    logs = Path("/tmp/ray/session_latest/logs")
    out = []
    for path in sorted(logs.glob("serve/controller_*.log")) + sorted(logs.glob("worker-*.err")):
        out += [ln[:300] for ln in path.read_text(errors="replace").splitlines()
                if "dsv4: autoscale" in ln or "Upscaling" in ln or "Downscaling" in ln]
    return out[-40:]


def upscaled_at(log: list[str], since: float) -> float | None:
    """Seconds from ``since`` (epoch) to Serve's first ``Upscaling`` line after it (the
    controller logs local time)."""
    for line in log:
        stamp = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) controller", line)
        if "Upscaling" in line and stamp:
            at = time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S"))
            at += int(stamp.group(2)) / 1000
            if at >= since - 1:
                return round(at - since, 1)
    return None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rows_of(sessions: dict[str, Any], steps: list[dict[str, Any]]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for arm, per_turn in sessions.get("ttft", {}).items():
        counts = [sorted((v.get("requests", 0.0) for v in rnd.values()), reverse=True)
                  for rnd in sessions["replicas"][arm]]
        hits = sum(v.get("hits", 0.0) for rnd in sessions["replicas"][arm] for v in rnd.values())
        queries = sum(v.get("queries", 0.0) for rnd in sessions["replicas"][arm]
                      for v in rnd.values())
        caching = str(sessions.get("prefix_caching", "unknown"))
        rate = ("n/a (prefix caching off)" if caching.startswith("False") or not queries
                else round(hits / queries, 3))
        for turn, values in sorted(per_turn.items(), key=lambda kv: int(kv[0])):
            used = sessions.get("prompt_tokens", {}).get(turn, [])
            rows.append([f"sessions/{arm}", int(turn), max(used, default=None),
                         round(statistics.median(values), 4), round(pct(values, 0.95), 4),
                         len(values), json.dumps(counts), f"{hits:g}/{queries:g}", rate,
                         None, None])
    for step in steps:
        rows.append([f"step/{step['policy']}", None, None, None, None, None, None, None,
                     None, step.get("seconds_to_decision"),
                     step["seconds_to_second_replica"]])
    return rows


def load_parts(workdir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The raw figures each part saved in ``workdir`` (parts run in separate, bounded
    invocations make one result)."""
    raw = workdir / "sessions.json"
    sessions = json.loads(raw.read_text()) if raw.exists() else {}
    steps = [json.loads((workdir / f"step-{p}.json").read_text())
             for p in ("kv_pressure", "serve_default") if (workdir / f"step-{p}.json").exists()]
    return sessions, steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-words", type=int, default=60)
    parser.add_argument("--turn-words", type=int, default=50)
    parser.add_argument("--step-concurrency", type=int, default=16)
    parser.add_argument("--step-timeout-s", type=float, default=300)
    parser.add_argument("--parts", default="sessions,step",
                        help="sessions, step (both policies), or one step:<policy>; each "
                             "part's figures are kept in --workdir and the result is made "
                             "from all of them, so parts can run in separate invocations")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dsv4-bench-session"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    if "sessions" in parts:
        save(args.workdir, "sessions", sessions_part(args, args.workdir))
    for policy in ("kv_pressure", "serve_default"):
        if "step" in parts or f"step:{policy}" in parts:
            save(args.workdir, f"step-{policy}", step_part(args, args.workdir, policy))
    sessions, steps = load_parts(args.workdir)
    print(write(args, sessions, steps))
    print(json.dumps(rows_of(sessions, steps), indent=1))
    return 0


def save(workdir: Path, part: str, figures: dict[str, Any]) -> None:
    (workdir / f"{part}.json").write_text(json.dumps(figures))


def write(args: argparse.Namespace, sessions: dict[str, Any],
          steps: list[dict[str, Any]]) -> Path:
    """The result file (``benchmarks/results/session_routing.json``), through
    ``write_result`` (date, commit, host filled in there)."""
    amx = any(f.startswith("amx") for f in host()["flags"])
    caching = sessions.get("prefix_caching", "not measured")
    notes = (
        f"vLLM's prefix caching on the sessions run: {caching}. "
        + ("This host has no AMX: vLLM turns DeepSeek-V4's prefix caching off on x86 "
           "without AMX (vllm/platforms/cpu.py), so there are no hits to count (hit rate "
           "n/a) and affinity cannot lower TTFT through the cache here; the TTFT and "
           "per-replica columns compare the routing only. " if not amx else "")
        + "Sessions: one 2-replica run (min = max = 2, nothing drained), arms interleaved "
        f"per round, order alternating, {sessions.get('rounds')} rounds; "
        "requests_per_replica_by_round = delivered requests "
        "per replica per round (ray_dsv4_serve_time_to_first_token_seconds_count). "
        + ("Load step: 1 replica (min 1, max 2, target_ongoing_requests 4) then "
           f"{args.step_concurrency} streams; seconds_to_decision = Serve's Upscaling line, "
           "seconds_to_second_replica = 2 replicas answering /v1/kv-spec (a new node and "
           "engine boot included). " if steps else "The load step (--parts step: two "
           "1 -> 2 clusters, ~10 min) is not in this result: it did not fit the run's time "
           "bound. ")
        + "Parts measured at: "
        + json.dumps({"sessions": sessions.get("date")} | {
            f"step/{st['policy']}": st.get("date") for st in steps})
        + ". Scaling lines per step arm: "
        + json.dumps({st["policy"]: [ln[-160:] for ln in st["controller_log"]
                                      if "Upscaling" in ln or "->" in ln][:6] for st in steps}))
    return write_result(
        "session_routing",
        title="Session affinity and KV-pressure autoscaling (local 2-node cluster)",
        what="TTFT p50/p95 per turn, requests per replica and prefix-cache hits/queries "
             "of a multi-turn session workload, today's routing (power of two) vs "
             "x-session-id affinity; seconds from a load step to the scale-up decision "
             "and to a second replica answering, kv_pressure vs Serve's default policy",
        command=this_command("benchmarks.session_routing"),
        inputs={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k != "parts"},
        columns=["arm", "turn", "prompt_tokens", "ttft_p50_s", "ttft_p95_s", "requests",
                 "requests_per_replica_by_round", "prefix_hits/queries",
                 "prefix_hit_rate", "seconds_to_decision", "seconds_to_second_replica"],
        rows=rows_of(sessions, steps), notes=notes)


if __name__ == "__main__":
    raise SystemExit(main())
