"""The processes of one local Ray session, read from ``/proc``: who belongs to it,
their command lines, its worker raylets, and signalling them.

Scoped by construction: ``deployments.local.cluster`` stops exactly these processes,
never Ray processes found machine-wide.
"""

from __future__ import annotations

import os
from pathlib import Path

FAKE_HEAD_NODE_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def session_pids(session: int) -> list[int]:
    """Live processes of one session (zombies excluded), ours by construction."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields and int(fields[3]) == session and fields[0] != "Z":
                pids.append(int(entry.name))
    return sorted(pids)


def _env_of(pid: int, name: str) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = name.encode() + b"="
    return next((v[len(prefix):].decode() for v in raw.split(b"\0") if v.startswith(prefix)),
                None)


def cmdline(pid: int) -> bytes:
    """The raw command line of ``pid`` (NUL-separated), empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def worker_raylets(session: int) -> dict[str, int]:
    """Ray node id -> raylet pid of every live worker node in ``session`` (the fake
    provider gives each node its id through RAY_OVERRIDE_NODE_ID_FOR_TESTING)."""
    out = {}
    for pid in session_pids(session):
        if cmdline(pid).split(b"\0")[0].endswith(b"/raylet/raylet"):
            node = _env_of(pid, "RAY_OVERRIDE_NODE_ID_FOR_TESTING")
            if node and node != FAKE_HEAD_NODE_ID:
                out[node] = pid
    return out


def signal_all(pids: list[int], signum: int) -> None:
    """Send ``signum`` to each of ``pids``; one already gone is skipped."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue
