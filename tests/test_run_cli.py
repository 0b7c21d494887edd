"""``dsv4-serve run`` as a user runs it: boots, prints URL + consensus + first token, stops clean.

Runs in its own process (its own private Ray cluster) before the session stack of
test_serving.py boots: both use port 8000, and the session fixture starts lazily.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import SERVING_LINE, read_until_serving

pytestmark = pytest.mark.slow

BOOT_TIMEOUT_S = 420
STOP_TIMEOUT_S = 90


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
    parents, found, frontier = _parents(), set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


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


def test_run_prints_url_consensus_first_token_and_stops_clean() -> None:
    exe = Path(sys.executable).with_name("dsv4-serve")
    started = time.monotonic()
    proc = subprocess.Popen([str(exe), "run"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        out = read_until_serving(proc, BOOT_TIMEOUT_S - (time.monotonic() - started))
        print(out)
        assert SERVING_LINE in out, out[-4000:]
        assert "OpenAI base URL: http://127.0.0.1:8000/v1" in out
        assert re.search(r"KV spec: agree \(policy enforce, expected fp8_ds_mla\); 2/2", out)
        first = re.search(r"first token after ([\d.]+) s \(request latency ([\d.]+) s\)", out)
        assert first, out[-4000:]
        print(f"dsv4-serve run: first token after {first.group(1)} s, "
              f"request latency {first.group(2)} s")
    finally:
        started_pids = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = proc.communicate(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, rest[-4000:]
    assert "SIGTERM: shutting down" in rest
    assert len(started_pids) > 5, f"expected Ray + replicas + engines, saw {started_pids}"
    deadline = time.monotonic() + 30
    while alive(started_pids) and time.monotonic() < deadline:
        time.sleep(1)
    leftovers = alive(started_pids)
    assert not leftovers, f"processes left after dsv4-serve run stopped: {leftovers}"


def test_run_rejects_a_bad_config_before_starting_ray(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path("configs/local-cpu.yaml").read_text().replace(
        "policy: enforce", "policy: enforcing"))
    exe = Path(sys.executable).with_name("dsv4-serve")
    started = time.monotonic()
    result = subprocess.run([str(exe), "run", str(bad)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "applications[dsv4].args.dsv4.policy" in result.stderr
    assert "'enforcing'" in result.stderr
    assert time.monotonic() - started < 60, "validation must not wait for Ray"
