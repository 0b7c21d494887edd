"""``dsv4_patch.patches.lifetime``: a spawned process ends when its owner is SIGKILLed.

Real processes, the way vLLM makes them: an owner process (standing in for the
Serve replica) spawns a child with ``multiprocessing`` spawn (what vLLM forces in
Ray actors); the child runs the watch, the owner is SIGKILLed (what a dying
raylet, the OOM killer or a lost node do), and the child must be gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from dsv4_patch import registry
from dsv4_patch.patches import lifetime
from dsv4_patch.patches.parent_watch import PARENT_WATCH
from tests.support.procs import pid_alive

ROOT = Path(__file__).resolve().parents[2]
OWNER = textwrap.dedent("""
    import multiprocessing, signal, sys, time

    def child(ignore_term, grace):
        if ignore_term:  # an engine stuck in its shutdown: only SIGKILL ends it
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        from dsv4_patch.patches import lifetime
        assert lifetime.watch_parent(grace_s=grace) is not None
        time.sleep(600)

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(target=child, args=(sys.argv[1] == "1", float(sys.argv[2])))
        proc.start()
        print(proc.pid, flush=True)
        time.sleep(600)
""")


def _orphan_outlives(tmp_path: Path, ignore_term: bool, grace_s: float,
                     within_s: float) -> bool:
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    owner = subprocess.Popen([sys.executable, str(script), str(int(ignore_term)),
                              str(grace_s)], stdout=subprocess.PIPE, text=True,
                             env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert owner.stdout is not None
    child = int(owner.stdout.readline())
    try:
        time.sleep(1.0)  # the child is up and watching
        assert pid_alive(child)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        deadline = time.monotonic() + within_s
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        return pid_alive(child)
    finally:
        if pid_alive(child):
            os.kill(child, signal.SIGKILL)


def test_child_ends_with_its_sigkilled_owner(tmp_path: Path) -> None:
    assert not _orphan_outlives(tmp_path, ignore_term=False, grace_s=30, within_s=10)


def test_child_stuck_in_shutdown_is_killed_after_the_grace(tmp_path: Path) -> None:
    assert not _orphan_outlives(tmp_path, ignore_term=True, grace_s=1, within_s=10)


def test_not_watching_where_multiprocessing_did_not_start_us() -> None:
    # pytest's own process: started by a shell, owned by nobody we know.
    assert lifetime.watch_parent() is None
    assert not lifetime.watching()
    result = PARENT_WATCH.apply(lifetime)  # the module argument is unused
    assert "not started by multiprocessing" in result.reason, result
    assert not lifetime.watching()


def test_the_watch_is_in_the_registry_and_the_doctor() -> None:
    from dsv4_patch import doctor

    assert PARENT_WATCH in registry.general_patches()
    [row] = [r for r in doctor.probe_patches() if r["name"] == PARENT_WATCH.name]
    assert row["needed"] == "yes", row
