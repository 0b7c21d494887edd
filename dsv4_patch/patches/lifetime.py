"""A vLLM engine process ends when the process that owns it ends.

Who owns what, in a Serve replica: the replica actor (a Ray worker process)
builds ``AsyncLLM``, which spawns ``VLLM::EngineCore`` (multiprocessing, spawn);
the engine core's executor spawns the ``VLLM::Worker`` processes. Only the owner
stops its children, and only on its own clean shutdown
(``CoreEngineProcManager.shutdown``). Workers watch their engine core through a
death pipe; the engine core watches nothing (vLLM 0.32, vllm-project/vllm#55510).
So when a replica process dies without running its shutdown -- the raylet and
GCS killed by a process-group SIGTERM or ``KillMode=control-group``, a node
lost, the OOM killer, ``SIGKILL`` -- nobody stops its engine: the engine core
(and through it its workers) lives on under PID 1, holding its memory and CPU.
Ray's own child reaping (``kill_child_processes_on_worker_exit``) is done by the
raylet, which is gone in exactly those cases.

The fix, at that cause: every process vLLM spawns watches its own parent
through the parent sentinel Python's ``multiprocessing`` hands every spawned
child (``multiprocessing.parent_process().sentinel``, readable once the parent
is gone, whatever killed it; no polling, no PID reuse race). When it fires, the
process sends itself SIGTERM, which runs vLLM's own shutdown (the engine core
aborts its requests and stops its workers); if that has not ended the process
after ``GRACE_S``, SIGKILL.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time

logger = logging.getLogger("dsv4_patch")

# vLLM's own shutdown of an engine core (abort requests, stop the workers) takes
# a few seconds on CPU; past this the process is killed.
GRACE_S = 20.0
THREAD_NAME = "dsv4-parent-watch"


def watching() -> bool:
    """True when this process already runs the parent watch."""
    return any(t.name == THREAD_NAME for t in threading.enumerate())


def watch_parent(grace_s: float = GRACE_S) -> str | None:
    """Start the parent watch; return the parent's PID, or None when nothing owns us.

    None for processes that ``multiprocessing`` did not start (a Ray worker, a
    shell-started ``vllm serve``): their lifetime is their starter's business.
    """
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return None
    if not watching():
        threading.Thread(target=_watch, args=(parent.pid, parent.sentinel, grace_s),
                         name=THREAD_NAME, daemon=True).start()
    return str(parent.pid)


def _watch(parent_pid: int | None, sentinel: int, grace_s: float) -> None:
    multiprocessing.connection.wait([sentinel])
    me = os.getpid()
    logger.warning("dsv4_patch: process %d lost its parent %s (the process that owns it); "
                   "shutting down with SIGTERM", me, parent_pid)
    os.kill(me, signal.SIGTERM)
    time.sleep(grace_s)
    logger.error("dsv4_patch: process %d still alive %.0f s after its parent %s died; "
                 "SIGKILL", me, grace_s, parent_pid)
    os.kill(me, signal.SIGKILL)
