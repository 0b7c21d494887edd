"""``dsv4-serve run`` as a process: its output up to the serving line, its process tree.

Shared by the multi-node scenario (``deployments.harness.multinode_scenario``) and the tests that
start ``dsv4-serve run`` themselves (tests/test_deployments/test_run_cli.py,
test_run_drain.py). Reads ``/proc``; imports nothing of the project.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

# What ``dsv4-serve run`` prints once it serves (deployments/cli/run.py).
SERVING_LINE = "Serving; Ctrl-C to stop."


def read_until_serving(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """``dsv4-serve run``'s output up to its "Serving" line (or EOF, or ``timeout_s``).

    The caller asserts ``SERVING_LINE`` is in the text; on a failed boot the text
    ends with the error. The deadline is checked between lines: the run prints
    progress while it boots.
    """
    assert proc.stdout is not None, "start the run with stdout=subprocess.PIPE"
    lines: list[str] = []
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(SERVING_LINE):
            break
    return "".join(lines)


def _parents() -> dict[int, int]:
    table = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
                table[int(proc.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return table


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (Ray daemons, replicas, vLLM engines, workers)."""
    parents, frontier = _parents(), {root}
    found: set[int] = set()
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found
