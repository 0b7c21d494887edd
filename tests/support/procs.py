"""Is a process still there? Read from ``/proc`` (a zombie counts as gone)."""

from __future__ import annotations

from pathlib import Path


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def alive(pids: set[int]) -> list[str]:
    out = []
    for pid in sorted(pids):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                out.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[:80]!r}")
        except OSError:
            continue
    return out
