"""The 2-node arms of ``benchmarks.serving_overhead``: every door to a replica on the
shape users deploy, ``dsv4-serve run --nodes 2`` (standing in for KubeRay).

Each arm is ``dsv4-serve run <config> --nodes 2`` itself (the code path of
``deployments.harness.multinode_scenario``): a private head with no CPUs, the
autoscaler adding one worker node (a raylet of its own) per replica, one replica per
node, ``configs/local-cpu.yaml``'s engine. Autoscaling is on and pinned at
min = initial = max = 2 (``--nodes 2`` caps max at 2, and both replicas must be up when
the load starts), so Serve's autoscaler runs and collects its metrics the whole time.

* ``mn-proxy`` -- through Serve's Python proxy on ``--port`` (head node only:
  ``proxy_location: HeadOnly``): what an autoscaled or multi-node app uses today;
* ``mn-haproxy`` -- ``http.ingress: haproxy``, what the KubeRay presets ship: Ray 2.60's
  HAProxy ingress on ``--port`` forwarding to each replica's own port on its app loop
  (``deployments.doors.haproxy_target``: Ray's direct-ingress port, from ``--port`` +
  10, plus the range's span), HAProxy run as ``dsv4-haproxy`` (stats
  ``--port`` + 2 and Prometheus ``--port`` + 3 on loopback), Serve's fallback proxy
  ``--port`` + 1; with an API key (the edge demands one whenever replicas listen
  themselves); drain by ``/-/healthz`` (``deployments.doors.dataplane``), no
  ``KVSpecRouter`` (Ray refuses one under HAProxy);
* ``mn-haproxy-1`` -- the same door with one replica on one worker node
  (``--nodes 1``): as many engines as plain vLLM, so c=1 and c=6 compare doors, not
  engine counts;
* ``mn-haproxy-inline-1`` (ablation) -- ``mn-haproxy-1`` with the replica's user code
  on Serve's own event loop (``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0``): what
  the thread hop of every streamed ASGI message costs on the shipped door;
* ``mn-haproxy-ray-1`` (ablation) -- ``mn-haproxy-1`` with ``DSV4_HAPROXY_TARGET=ray``:
  HAProxy forwards to Ray's direct-ingress server on Serve's loop, which hands every
  streamed ASGI message across threads to the app (the shipped door before issue 34);
* ``mn-replica-port`` -- ``http.replica_port`` = ``--port`` (both replicas share it by
  ``SO_REUSEPORT``, possible only because both "nodes" are this one machine and
  min = max), Serve's proxy on ``--port`` + 5.

``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING`` is not an arm: in Ray 2.60 it is read only by
``ray.serve.llm``'s builders (``build_openai_app``, the P/D and data-parallel builders),
which then deploy ``LLMServer`` itself as the ingress with ``LLMRouter`` as its request
router. ``deployments.app.build_app`` uses none of them: its ``DSv4Server`` replicas are
already the ingress, so the flag would change nothing on our path.
"""

from __future__ import annotations

import copy
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from benchmarks.overhead_arms import CONFIG, DIRECT_KEY, MN_ARMS, PROXY_OFFSET, USER_THREAD_FLAG
from deployments import serve_env

NODES = 2
SERVING_LINE = "Serving; Ctrl-C to stop."
_SESSION = re.compile(r"local cluster head at \S+ \(session (\d+)")
# The engine's own processes: what the serving path is compared without.
ENGINE_ROLES = ("engine", "engine-worker")


def mn_config(arm: str, port: int) -> dict[str, Any]:
    """``configs/local-cpu.yaml`` for one 2-node arm: the door on ``port``, autoscaling
    pinned at two replicas (one per node)."""
    if arm not in MN_ARMS:
        raise ValueError(f"arm={arm!r}: expected one of {MN_ARMS}")
    raw = copy.deepcopy(yaml.safe_load(CONFIG.read_text()))
    args = raw["applications"][0]["args"]
    nodes = mn_nodes(arm)
    args["llm"]["deployment_config"]["autoscaling_config"] = {
        "min_replicas": nodes, "initial_replicas": nodes, "max_replicas": nodes,
        "target_ongoing_requests": 4,
    }
    if arm == "mn-replica-port":
        raw["http_options"]["port"] = port + PROXY_OFFSET
        args["http"]["replica_port"] = port
    else:
        if arm.startswith("mn-haproxy"):
            args["http"]["ingress"] = "haproxy"
        raw["http_options"]["port"] = port
        args["http"].pop("replica_port", None)
    return raw


def mn_env(arm: str, port: int) -> dict[str, str]:
    """The Ray Serve flags of an arm's ``dsv4-serve run`` (every Ray process inherits them)."""
    if not arm.startswith("mn-haproxy"):
        return {}
    inline = {USER_THREAD_FLAG: "0"} if "-inline" in arm else {}
    target = {serve_env.HAPROXY_TARGET_FLAG: "ray"} if "-ray" in arm else {}
    return (serve_env.haproxy_ports_beside(port, mn_nodes(arm))
            | {"DSV4_API_KEYS": DIRECT_KEY} | inline | target)


def mn_nodes(arm: str) -> int:
    """Worker nodes (one replica each) of a 2-node arm: ``-1`` arms run one."""
    return 1 if arm.endswith("-1") else NODES


def mn_command(arm: str, port: int, workdir: Path) -> tuple[list[str], dict[str, str]]:
    """``dsv4-serve run`` of the arm's config (written to ``workdir``) on 2 nodes."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / f"{arm}.yaml"
    config.write_text(yaml.safe_dump(mn_config(arm, port)))
    exe = str(Path(sys.executable).with_name("dsv4-serve"))
    cmd = [exe, "run", str(config), "--nodes", str(mn_nodes(arm)), "--no-smoke",
           "--node-idle-timeout-s", "600"]
    return cmd, mn_env(arm, port)


def cluster_session(log: Path) -> int | None:
    """The session of the arm's local cluster (head, autoscaler, worker nodes), from
    ``dsv4-serve run``'s output; None before it printed it."""
    match = _SESSION.search(log.read_text(errors="replace")) if log.exists() else None
    return int(match.group(1)) if match else None


def wait_serving(log: Path, alive: Any, timeout_s: float) -> None:
    """Until ``dsv4-serve run`` says it serves: both replicas RUNNING, the verdict in."""
    end = time.monotonic() + timeout_s
    while SERVING_LINE not in log.read_text(errors="replace"):
        if not alive():
            raise RuntimeError(f"dsv4-serve run exited; log {log}:\n"
                               + log.read_text(errors="replace")[-4000:])
        if time.monotonic() > end:
            raise TimeoutError(f"dsv4-serve run not serving in {timeout_s}s; log {log}")
        time.sleep(2)


def listeners(procs: list[psutil.Process], role_of: Any) -> list[str]:
    """"role addr:port" of every TCP socket the arm's processes listen on."""
    out = set()
    for proc in procs:
        try:
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for conn in conns:
            if conn.status == psutil.CONN_LISTEN:
                out.add(f"{role_of(proc)} {conn.laddr.ip}:{conn.laddr.port}")
    return sorted(out)


def cpu_per_work(before: dict[str, float], after: dict[str, float], requests: int,
                 tokens: int, idle_cores: dict[str, float] | None = None,
                 wall_s: float = 0.0) -> dict[str, dict[str, float]]:
    """Per role: CPU-ms per request and per output token over one load; with the role's
    CPU at rest (``idle_cores``, measured before the load) also the marginal CPU-ms per
    token: what the load added over the ``wall_s`` seconds it ran. The rest is
    time-based (loops that run whether tokens flow or not): on a GPU node it is spread
    over ~1,000x the tokens, the marginal part is not."""
    out = {}
    for role in sorted(before.keys() | after.keys()):
        ms = 1000 * (after.get(role, 0.0) - before.get(role, 0.0))
        out[role] = {"ms_per_req": ms / max(requests, 1), "ms_per_tok": ms / max(tokens, 1)}
        if idle_cores is not None:
            extra = ms - 1000 * idle_cores.get(role, 0.0) * wall_s
            out[role]["marginal_ms_per_tok"] = extra / max(tokens, 1)
            out[role]["idle_cores"] = idle_cores.get(role, 0.0)
    return out


def path_total(cpu: dict[str, dict[str, float]], key: str) -> float:
    """The serving path's CPU (every process but the engine core and its worker)."""
    return sum(v.get(key, 0.0) for role, v in cpu.items() if role not in ENGINE_ROLES)


AT_RATE = "at_rate_ms_per_tok"


def role_cpu(run: dict[str, Any], key: str) -> dict[str, dict[str, float]]:
    """A run's per-role CPU, with ``AT_RATE`` derived: the marginal CPU per token plus
    the role's cores at rest spread over the tokens the load made per second. That is
    what each token costs a node streaming at that rate, without the seconds the load
    client spends starting (which the all-in figure bills to a short load)."""
    cpu: dict[str, dict[str, float]] = run.get("cpu", {})
    if key != AT_RATE:
        return cpu
    rate = float(run.get("output_throughput") or 0.0)
    return {role: {AT_RATE: v["marginal_ms_per_tok"] + 1000 * v["idle_cores"] / rate}
            for role, v in cpu.items() if rate > 0 and "marginal_ms_per_tok" in v}


def cpu_rows(runs: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Per role, the median over an arm's runs of ``key``; "path" and "all" totals."""
    with_cpu = [role_cpu(r, key) for r in runs if "cpu" in r]
    roles = sorted({role for cpu in with_cpu for role in cpu})
    rows = {role: statistics.median(cpu.get(role, {}).get(key, 0.0) for cpu in with_cpu)
            for role in roles}
    if with_cpu:
        rows["path"] = statistics.median(path_total(cpu, key) for cpu in with_cpu)
        rows["all"] = statistics.median(sum(v.get(key, 0.0) for v in cpu.values())
                                        for cpu in with_cpu)
    return rows


CPU_VIEWS = (  # (key, what a cell is)
    ("ms_per_tok", "CPU-ms per out token (per request)"),
    ("marginal_ms_per_tok", "marginal CPU-ms per out token (over the role's CPU at rest)"),
    (AT_RATE, "CPU-ms per out token at the load's rate (marginal + rest / tok/s)"),
    ("idle_cores", "cores at rest (before the load)"),
)


def cpu_table(arm_runs: dict[str, list[dict[str, Any]]], order: tuple[str, ...],
              key: str = "ms_per_tok") -> str:
    """Markdown: one of ``CPU_VIEWS`` by role, median over the runs (all-in figures with
    the CPU-ms per request beside them); "path" = every process but the engine core and
    its worker."""
    arms = [a for a in order if any(key in v for r in arm_runs.get(a, [])
                                    for v in role_cpu(r, key).values())]
    if not arms:
        return ""
    cells_of = {a: cpu_rows(arm_runs[a], key) for a in arms}
    req = {a: cpu_rows(arm_runs[a], "ms_per_req") for a in arms}
    roles = sorted({role for a in arms for role in cells_of[a]} - {"path", "all"})
    label = dict(CPU_VIEWS)[key]
    lines = [f"| {label} | " + " | ".join(arms) + " |", "|---" * (1 + len(arms)) + "|"]
    # Rows below 1 % of the largest total say nothing (GPU-rate runs are ~100x smaller).
    small = 0.01 * max((abs(cells_of[a].get("all", 0.0)) for a in arms), default=0.5)
    for role in (*roles, "path", "all"):
        if all(abs(cells_of[a].get(role, 0.0)) < small for a in arms):
            continue
        cells = [f"{cells_of[a].get(role, 0.0):.3f}" if key == "idle_cores" else
                 f"{cells_of[a].get(role, 0.0):.3g}" + (
                     f" ({req[a].get(role, 0.0):.1f})" if key == "ms_per_tok" else "")
                 for a in arms]
        lines.append(f"| {role} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
