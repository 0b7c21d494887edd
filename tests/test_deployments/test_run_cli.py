"""``dsv4-serve run`` as a user runs it: boots, prints URL + consensus + first token, stops clean.

Runs in its own process (its own private Ray cluster) on the default config with its
two doors moved to ports 8020 (replicas) and 8021 (Serve's proxy): the session stack
(``conftest.serve_stack``, booted by test_kv_controller.py, which sorts first) holds 8000
and 8500 for the whole session, and ``run`` refuses a busy port before Ray starts.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Set as AbstractSet
from pathlib import Path

import pytest
import yaml

from deployments.config import DEFAULT_CONFIG
from deployments.harness.kv_poll import TRANSIENT, kv_report
from deployments.harness.multinode_scenario import FULL_FAULTS
from deployments.harness.run_process import SERVING_LINE, descendants, read_until_serving
from tests.support.procs import alive

pytestmark = pytest.mark.slow

BOOT_TIMEOUT_S = 420
STOP_TIMEOUT_S = 90
PORT = 8020  # the replicas' own door; Serve's proxy on PORT + 1
URL = f"http://127.0.0.1:{PORT}/v1"


def default_config_on_own_ports(tmp_path: Path) -> Path:
    """configs/local-cpu.yaml as shipped, only its two ports moved off the session stack's."""
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["http_options"]["port"] = PORT + 1
    raw["applications"][0]["args"]["http"]["replica_port"] = PORT
    path = tmp_path / "local-cpu-own-ports.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def processes_named(pids: set[int], fragment: bytes) -> list[int]:
    """The pids among ``pids`` whose command line contains ``fragment``."""
    found = []
    for pid in sorted(pids):
        try:
            if fragment in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def wait_for_agreement(url: str, replicas: int, replaced: AbstractSet[str] = frozenset(),
                       timeout_s: float = 300) -> dict:
    """Until /v1/kv-spec agrees over ``replicas`` replicas, one of them not in ``replaced``
    when that is given (a replacement has joined)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            status, body = kv_report(url, timeout=60)
            ids = {r["id"] for r in body.get("replicas", [])}
            last = (status, body.get("state"), sorted(ids))
            if (status == 200 and len(ids) == replicas
                    and (not replaced or ids - replaced)):
                return body
        except TRANSIENT as exc:  # a replica lost in flight, a proxy restarting
            last = repr(exc)
        time.sleep(2)
    raise AssertionError(f"no agreement over {replicas} replicas in {timeout_s} s: {last}")


def kill_one_replica_and_wait_for_its_replacement(url: str, run_pid: int) -> None:
    before = wait_for_agreement(url, 2)
    [replica, *_] = processes_named(descendants(run_pid), b"ServeReplica:dsv4:DSv4Server")
    killed_at = time.monotonic()
    os.kill(replica, signal.SIGKILL)
    wait_for_agreement(url, 2, replaced={r["id"] for r in before["replicas"]})
    print(f"replica {replica} SIGKILLed: replaced and agreeing after "
          f"{time.monotonic() - killed_at:.1f} s")


def test_run_serves_heals_a_killed_replica_and_a_group_sigterm_leaves_nothing(
        tmp_path: Path) -> None:
    """Boot as a user does; SIGKILL a replica, Serve replaces it (``make test-faults``
    only: one more engine boot); then SIGTERM to the
    whole process group (``kill -TERM -PGID``, systemd's control-group stop): gcs_server
    and the raylet die with ``run``, the replicas with the raylet, and every engine
    (``VLLM::EngineCore``/``VLLM::Worker``) with its replica; ``run`` exits 0."""
    exe = Path(sys.executable).with_name("dsv4-serve")
    started = time.monotonic()
    proc = subprocess.Popen([str(exe), "run", str(default_config_on_own_ports(tmp_path))],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        out = read_until_serving(proc, BOOT_TIMEOUT_S - (time.monotonic() - started))
        print(out)
        assert SERVING_LINE in out, out[-4000:]
        assert f"OpenAI base URL: {URL}" in out
        assert re.search(r"KV spec: agree \(policy enforce, expected fp8_ds_mla, "
                         r"reference prediction[^)]*\); 2/2", out), out[-4000:]
        first = re.search(r"first token after ([\d.]+) s \(request latency ([\d.]+) s\)", out)
        assert first, out[-4000:]
        print(f"dsv4-serve run: first token after {first.group(1)} s, "
              f"request latency {first.group(2)} s")
        engines_before = set(processes_named(descendants(proc.pid), b"VLLM::EngineCore"))
        if FULL_FAULTS:
            kill_one_replica_and_wait_for_its_replacement(URL, proc.pid)
    finally:
        started_pids = descendants(proc.pid)
        engines = set(processes_named(started_pids, b"VLLM::"))
        os.killpg(proc.pid, signal.SIGTERM)
        stop_at = time.monotonic()
        try:
            rest, _ = proc.communicate(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    print(rest[-2000:])
    assert proc.returncode == 0, rest[-4000:]
    assert "SIGTERM: shutting down" in rest
    assert len(started_pids) > 5, f"expected Ray + replicas + engines, saw {started_pids}"
    assert len(engines) >= 4, f"expected 2 engines x (EngineCore + Worker), saw {engines}"
    assert engines_before, "no engine seen before the kill"
    # Engines are not in the run's process group (Ray puts each worker in its own):
    # only their owners' deaths can stop them.
    deadline = stop_at + 45
    while alive(started_pids | engines_before) and time.monotonic() < deadline:
        time.sleep(1)
    leftovers = alive(started_pids | engines_before)
    print(f"group SIGTERM: run exited 0, nothing left after {time.monotonic() - stop_at:.1f} s")
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


def test_run_rejects_a_bad_haproxy_check_setting_before_starting_ray(tmp_path: Path) -> None:
    """The local drain window comes from HAProxy's check settings: a bad one is named,
    with its fix, before anything starts."""
    raw = yaml.safe_load(Path("configs/local-cpu.yaml").read_text())
    http = raw["applications"][0]["args"]["http"]
    http.pop("replica_port", None)
    http["ingress"] = "haproxy"
    config = tmp_path / "haproxy.yaml"
    config.write_text(yaml.safe_dump(raw))
    exe = Path(sys.executable).with_name("dsv4-serve")
    env = os.environ | {"RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL": "two",
                        "DSV4_API_KEYS": "k" * 32}
    result = subprocess.run([str(exe), "run", str(config)], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL='two'" in result.stderr
    assert "Fix" in result.stderr
