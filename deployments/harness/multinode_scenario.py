"""The multi-node scenario, step by step: shared by
tests/test_deployments/test_multinode.py (in CI) and benchmarks/multinode.py (timings for
docs/benchmarks.md).

It imports only ``deployments`` (``harness.kv_poll``, ``harness.run_process``).

Everything runs the way a user runs it: ``dsv4-serve run --nodes N`` in its own
process group, real HTTP on 127.0.0.1, Ray's autoscaler adding and removing
worker nodes (separate raylets), real vLLM engines. Faults are real signals to
real processes of the cluster's session, found through ``/proc``.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from deployments import serve_env
from deployments.config import DEFAULT_CONFIG
from deployments.harness.kv_poll import TRANSIENT, kv_report
from deployments.harness.run_process import SERVING_LINE, descendants, read_until_serving
from deployments.local.cluster import (
    FAKE_HEAD_NODE_ID,
    cmdline,
    session_pids,
    worker_raylets,
)

PORT = 8020
URL = f"http://127.0.0.1:{PORT}/v1"
# The story runs behind the door the KubeRay presets ship (HAProxy), which makes every
# replica's own port answer too: so the edge demands a key, loopback included.
KEY = "multinode-scenario-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Enough direct-ingress ports for max_replicas plus replacements whose old port is held
STORY_ENV = {"DSV4_API_KEYS": KEY} | serve_env.haproxy_ports_beside(PORT, replicas=4)
BOOT_TIMEOUT_S = 420
STEP_TIMEOUT_S = 300
PERIOD_S = 3  # the KV-spec controller's period: the verdict follows within it
# The single-node replica kill (one more engine boot) runs with `make test-faults`;
# `make test` stays within its budget. Node loss is in `make test`.
FULL_FAULTS = os.environ.get("DSV4_FULL_FAULTS") == "1"


def autoscaling_config_file(tmp: Path, max_replicas: int = 2) -> Path:
    """The local app, autoscaled 1..max_replicas, reacting within seconds (for tests)."""
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["http_options"]["port"] = PORT
    args = raw["applications"][0]["args"]
    args["llm"]["deployment_config"]["autoscaling_config"] = {
        "min_replicas": 1, "initial_replicas": 1, "max_replicas": max_replicas,
        "target_ongoing_requests": 2, "upscale_delay_s": 2, "downscale_delay_s": 8,
        "metrics_interval_s": 1, "look_back_period_s": 3,
    }
    args["dsv4"]["controller_period_s"] = PERIOD_S
    # Autoscaled, so no shared replica port (its requests are invisible to Serve's
    # autoscaler; the config refuses): Ray's HAProxy, where each replica reports its own
    # ongoing requests to the autoscaler, as on KubeRay.
    args["http"].pop("replica_port", None)
    args["http"]["ingress"] = "haproxy"
    # Stored responses in the fleet's store (SQLite: every node of a local run is on this
    # machine), so a node lost or scaled down takes none of them along.
    args["http"]["responses_store"] = True
    args["responses"] = {"sqlite_path": str(tmp / "responses.sqlite3")}
    path = tmp / "autoscaled.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@dataclass
class Run:
    """A running ``dsv4-serve run --nodes N`` and its cluster's session."""

    proc: subprocess.Popen[str]
    boot_output: str
    session: int
    marks: dict[str, float] = field(default_factory=dict)

    def all_pids(self) -> set[int]:
        """Every live process of the run: its own tree plus the cluster's session
        (HAProxy included: Ray's HAProxy manager starts it in the session)."""
        return {self.proc.pid} | descendants(self.proc.pid) | set(session_pids(self.session))

    def haproxy_configs(self) -> dict[int, Path]:
        """pid -> config of the run's HAProxy processes."""
        return haproxy_configs(session_pids(self.session))


def start_run(config: Path, nodes: int, idle_timeout_s: float,
              env: dict[str, str] | None = None) -> Run:
    exe = Path(sys.executable).with_name("dsv4-serve")
    proc = subprocess.Popen(  # noqa: S603  # our own CLI, fixed arguments
        [str(exe), "run", str(config), "--nodes", str(nodes), "--no-smoke",
         "--node-idle-timeout-s", str(idle_timeout_s)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env=os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {}))
    try:
        out = read_until_serving(proc, BOOT_TIMEOUT_S)
        assert SERVING_LINE in out, out[-4000:]
        session = re.search(r"local cluster head at \S+ \(session (\d+)", out)
        assert session, out[-4000:]
        return Run(proc, out, int(session.group(1)))
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def report() -> dict[str, Any]:
    status, body = kv_report(URL, headers=AUTH)
    return body | {"http_status": status}


def wait_report(predicate: Any, what: str, timeout_s: float = STEP_TIMEOUT_S) -> dict[str, Any]:
    """Poll /v1/kv-spec until ``predicate(report)``; the last report in the error."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    transient: list[str] = []
    while time.monotonic() < deadline:
        try:
            last = report()
            if predicate(last):
                if transient:
                    print(f"{what}: {len(transient)} polls answered no report on the way: "
                          f"{transient[:3]}")
                return last
        except TRANSIENT as exc:  # the ingress answers again shortly
            last = repr(exc)
            transient.append(last)
        time.sleep(1)
    raise AssertionError(f"{what}: not reached in {timeout_s} s; last report {last}; "
                         f"{len(transient)} polls answered no report")


def agreeing(count: int, *, new_node_besides: set[str] | None = None) -> Any:
    """A predicate: agree over ``count`` replicas on ``count`` distinct worker nodes
    (and, if given, on at least one node not in ``new_node_besides``)."""
    def check(rep: dict[str, Any]) -> bool:
        nodes = [r.get("node_id") for r in rep.get("replicas", [])]
        return (rep.get("state") == "agree" and rep["answered"] == rep["running_replicas"]
                == count and len(set(nodes)) == count and FAKE_HEAD_NODE_ID not in nodes
                and (new_node_besides is None or bool(set(nodes) - new_node_besides)))
    return check


def replica_nodes(rep: dict[str, Any]) -> dict[str, str]:
    """Replica id -> Ray node id, from a report."""
    return {r["id"]: r["node_id"] for r in rep["replicas"]}


def pss_mib(pids: set[int]) -> float:
    """Proportional set size of ``pids`` together (shared pages counted once), MiB."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def stop_run(run: Run, timeout_s: float = 120) -> tuple[int, str, float]:
    """SIGTERM to the run's process group; (exit code, output, seconds)."""
    started = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGTERM)
    try:
        rest, _ = run.proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(run.proc.pid, signal.SIGKILL)
        raise
    return run.proc.returncode, rest, time.monotonic() - started


def haproxy_configs(pids: list[int]) -> dict[int, Path]:
    """pid -> config, for those of ``pids`` that are HAProxy as ``dsv4-haproxy`` left it
    (Ray 2.60 keeps one config per node, /tmp/haproxy-serve/<node id>/haproxy.cfg, and
    reloads HAProxy as a new process on each change)."""
    found = {}
    for pid in pids:
        args = cmdline(pid).decode(errors="replace").split("\0")
        for flag, value in itertools.pairwise(args):
            if flag == "-f" and value.endswith(".dsv4.cfg") and "haproxy-serve" in value:
                found[pid] = Path(value)
    return found


def kill_leftovers(run: Run) -> None:
    """SIGKILL what a run left: its process group if it still runs, its cluster's
    session processes, HAProxy among them (a test that failed midway)."""
    if run.proc.poll() is None:
        os.killpg(run.proc.pid, signal.SIGKILL)
    for pid in session_pids(run.session):
        os.kill(pid, signal.SIGKILL)


def worker_nodes(run: Run) -> dict[str, int]:
    """Ray node id -> raylet pid of the live worker nodes of the run's cluster."""
    return worker_raylets(run.session)
