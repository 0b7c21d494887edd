"""The processes of one serving arm: find them and name their role.

A serving arm (``benchmarks.serving_overhead``) is one session: the arm's server
process and everything it starts (Ray's system processes, Serve's proxy and replicas,
vLLM's engine core and worker). Profiles and CPU accounting need to know which process
does what. (Their environment cannot be read back reliably from
``/proc/<pid>/environ``: the plain-vLLM arm's engine processes showed none of the
variables their own log proves they had, likely because of ``setproctitle``; the
benchmark records the environment it gives the engines instead.)
"""

from __future__ import annotations

import collections
import os
import re

import psutil

ROLES = (  # (role, pattern on the process command line / title), first match wins
    # Serve's HAProxy ingress: the haproxy binary, and the actor that manages it.
    ("haproxy", re.compile(r"(^|/)haproxy( |$)")),
    ("haproxy-manager", re.compile(r"HAProxyManager")),
    ("proxy", re.compile(r"ProxyActor")),
    ("controller", re.compile(r"KVSpecController")),
    ("standin", re.compile(r"StandInReplica")),  # deployments.harness.standin
    # Stock Ray Serve LLM's OpenAiIngress replica (ours has none since issue 16).
    ("ingress", re.compile(r"ServeReplica:\w+:\w*Ingress")),
    ("server", re.compile(r"ServeReplica:\w+:(DSv4Server|LLMServer|DSv4DPServer)")),
    ("engine", re.compile(r"VLLM::EngineCore|EngineCore")),
    ("engine-worker", re.compile(r"VLLM::Worker|VllmWorker")),
    ("serve-controller", re.compile(r"ServeController")),
    ("vllm-api", re.compile(r"vllm\.entrypoints\.openai\.api_server")),
    # Ray's daemons, one role each (what a local run keeps resident at rest).
    ("ray-gcs", re.compile(r"gcs_server")),
    ("ray-raylet", re.compile(r"/raylet\b|raylet/raylet")),
    ("ray-dashboard-agent", re.compile(r"dashboard/agent\.py|dashboard_agent|ray::DashboardAgent")),
    ("ray-runtime-env-agent", re.compile(r"runtime_env/agent|ray::RuntimeEnvAgent")),
    ("ray-telemetry-agent", re.compile(r"ray::TelemetryAgent")),
    ("ray-log-monitor", re.compile(r"log_monitor")),
    ("ray-monitor", re.compile(r"autoscaler/_private/monitor|monitor\.py")),
    ("ray-dashboard", re.compile(r"dashboard\.py")),
    ("ray-idle-worker", re.compile(r"ray::IDLE|default_worker")),
    # The arm's own server process: the Ray driver (serving_overhead --serve-arm, or
    # dsv4-serve run); multiprocessing's resource tracker (vLLM's engine start).
    ("driver", re.compile(r"--serve-arm|dsv4-serve run|deployments\.cli.* run|"
                          r"benchmarks\.multinode_arms run")),
    ("mp-resource-tracker", re.compile(r"multiprocessing\.resource_tracker")),
    ("ray-system", re.compile(r"gcs_server|raylet|dashboard|log_monitor|monitor\.py|"
                              r"runtime_env|ray::IDLE|default_worker")),
)


def role_of(proc: psutil.Process) -> str:
    """The arm role of ``proc`` by its command line or title; "gone" if it exited."""
    try:
        text = " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    for role, pattern in ROLES:
        if pattern.search(text):
            return role
    return "other"


def session_processes(root_pid: int) -> list[psutil.Process]:
    """Every live process of the arm, its server process included: the session it leads."""
    out = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid == root_pid or os.getsid(proc.pid) == root_pid:
                out.append(proc)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return out


def cpu_by_role(procs: list[psutil.Process]) -> dict[str, float]:
    """CPU seconds (user + system) each role's processes used so far, summed."""
    totals: dict[str, float] = collections.defaultdict(float)
    for proc in procs:
        try:
            t = proc.cpu_times()
            totals[role_of(proc)] += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return dict(totals)


def cpu_by_thread(procs: list[psutil.Process]) -> dict[str, float]:
    """CPU seconds (user + system) of every thread so far, keyed ``role pid tid name``
    (the kernel's thread name: Ray's C++ threads name themselves, Python's threads carry
    the process title; ``python_threads`` names those)."""
    out: dict[str, float] = {}
    for proc in procs:
        role = role_of(proc)
        try:
            threads = proc.threads()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for thread in threads:
            out[f"{role} {proc.pid} {thread.id} {_thread_name(proc.pid, thread.id)}"] = (
                thread.user_time + thread.system_time)
    return out


def _thread_name(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as comm:
            return comm.read().strip().replace(" ", "_")
    except OSError:
        return "gone"


_PY_THREAD = re.compile(r'^Thread (?P<tid>\d+) \([^)]*\): "(?P<name>[^"]*)"')


def python_threads(dump: str) -> dict[int, str]:
    """Native thread id -> Python thread name, from ``py-spy dump`` output, which names
    each thread by its OS id (``Thread 4421 (idle): "Thread-1 (_run_user_code_event_loop)"``)."""
    return {int(m["tid"]): m["name"] for line in dump.splitlines()
            if (m := _PY_THREAD.match(line))}
