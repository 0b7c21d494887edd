"""``http.ingress: haproxy`` on two nodes (``dsv4-serve run --nodes 2``, the KubeRay
stand-in), in order on one cluster: the API key is demanded at HAProxy's door, every
socket the cluster listens on is loopback (HAProxy's stats page and Prometheus exporter
included: ``dsv4-haproxy``), a replica the KV-spec check drains fails its ``/-/healthz``
and HAProxy sends it nothing while the other serves, and SIGTERM stops everything,
HAProxy too.

Rank 0 runs another layer order (``replica_overrides``) under policy ``drain``: the
controller drains it from the first verdict, and the other replica keeps serving (the
drain fails open only when no other replica would be left).
"""

from __future__ import annotations

import csv
import io
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from deployments import serve_env
from deployments.config import DEFAULT_CONFIG
from deployments.harness import multinode_scenario as mn
from deployments.harness.kv_poll import TRANSIENT, kv_report
from tests.support.procs import alive
from tests.support.stack import ODD_ENGINE_KWARGS, ODD_RANK

pytestmark = pytest.mark.slow

PORT = 8040
URL = f"http://127.0.0.1:{PORT}/v1"
KEY = "haproxy-door-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
SIDE_ENV = serve_env.haproxy_ports_beside(PORT, replicas=3)
# Ray's direct-ingress ports are range(MIN, MAX); the replicas' own ones follow them.
_RAY_RANGE = serve_env.direct_ingress_range(SIDE_ENV)
OWN_PORTS = (_RAY_RANGE[1], 2 * _RAY_RANGE[1] - _RAY_RANGE[0])
MODEL = "dsv4-tiny"


def haproxy_config(tmp: Path) -> Path:
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["http_options"]["port"] = PORT
    args = raw["applications"][0]["args"]
    args["llm"]["deployment_config"]["autoscaling_config"] = {
        "min_replicas": 2, "initial_replicas": 2, "max_replicas": 2,
        "target_ongoing_requests": 4}
    args["http"].pop("replica_port", None)
    args["http"]["ingress"] = "haproxy"
    args["dsv4"].update(policy="drain", controller_period_s=mn.PERIOD_S, replica_overrides=[
        {"rank": ODD_RANK, "engine_kwargs": ODD_ENGINE_KWARGS,
         "reason": "test: a replica configured to differ"}])
    path = tmp / "haproxy.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def admin_socket(run: mn.Run) -> str:
    """The admin socket of the run's HAProxy, from its own config."""
    [config] = set(run.haproxy_configs().values())
    [line] = [ln for ln in config.read_text().splitlines() if "stats socket" in ln]
    return line.split()[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[mn.Run]:
    config = haproxy_config(tmp_path_factory.mktemp("haproxy"))
    the_run = mn.start_run(config, 2, 600.0, env={"DSV4_API_KEYS": KEY} | SIDE_ENV)
    try:
        yield the_run
    finally:
        mn.kill_leftovers(the_run)  # only if a step failed midway


def server_rows(run: mn.Run) -> list[dict[str, str]]:
    """HAProxy's own view of the app's replica servers (``show stat`` on the admin
    socket; the fallback proxy, a backup server, left out)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(admin_socket(run))
        sock.sendall(b"show stat\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    rows = csv.DictReader(io.StringIO(data.decode().lstrip("# ")))
    return [r for r in rows if r["svname"] not in ("FRONTEND", "BACKEND")
            and r.get("bck") == "0" and r["pxname"] not in ("stats", "prometheus")]


def chat(max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{URL}/chat/completions", headers=AUTH, timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens})


def test_the_door_demands_the_key_and_serves_with_it(run: mn.Run) -> None:
    assert "http.ingress: haproxy" in run.boot_output, run.boot_output[-3000:]
    refused = httpx.post(f"{URL}/chat/completions", timeout=30,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert refused.status_code == 401, refused.text
    served = chat()
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] > 0


def test_haproxy_sends_requests_to_the_replicas_own_ports(run: mn.Run) -> None:
    """Each server line points at the replica's own port (Ray's port + the range's
    span), which a replica process listens on, and requests are served there (not by
    the backup, Serve's fallback proxy, which HAProxy uses only with every replica down).
    HAProxy's counters restart at each reload, so they are read right after requests."""
    own = set(range(*OWN_PORTS))
    for _ in range(4):
        assert chat(2).status_code == 200
    rows = server_rows(run)
    addrs = {r["svname"]: r["addr"] for r in rows}
    assert len(addrs) == 2 and all(int(a.rsplit(":", 1)[1]) in own
                                   for a in addrs.values()), addrs
    listening = {conn.laddr.port for pid in run.all_pids() for conn in _listening(pid)}
    assert {int(a.rsplit(":", 1)[1]) for a in addrs.values()} <= listening, (addrs, listening)
    assert sum(int(r["stot"]) for r in rows) >= 1, rows


def test_every_socket_of_the_cluster_is_loopback(run: mn.Run) -> None:
    pids = run.all_pids()
    assert run.haproxy_configs(), "no HAProxy process of the run"
    listening = {}
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        for conn in conns:
            if conn.status == psutil.CONN_LISTEN:
                listening[(conn.laddr.ip, conn.laddr.port)] = pid
    ports = {port for _, port in listening}
    assert {PORT, PORT + 1, PORT + 2, PORT + 3} <= ports, sorted(listening)
    wide = {addr: pid for addr, pid in listening.items()
            if addr[0] not in ("127.0.0.1", "::1")
            and addr[1] in {PORT, PORT + 1, PORT + 2, PORT + 3} | set(range(PORT + 10, PORT + 14))
            | set(range(*OWN_PORTS))}
    assert not wide, f"beyond loopback: {wide}"
    assert oct(os.stat(admin_socket(run)).st_mode & 0o777) == "0o600"


def _listening(pid: int) -> list[Any]:
    try:
        conns = psutil.Process(pid).net_connections(kind="inet")
    except psutil.Error:
        return []
    return [conn for conn in conns if conn.status == psutil.CONN_LISTEN]


def _report() -> dict[str, Any]:
    return kv_report(URL, headers=AUTH)[1]


def test_a_drained_replica_leaves_haproxys_rotation(run: mn.Run) -> None:
    deadline = time.monotonic() + mn.STEP_TIMEOUT_S
    rows: list[dict[str, str]] = []
    actions: dict[str, str] = {}
    while time.monotonic() < deadline:
        try:
            actions = {r["id"]: r["action"] for r in _report().get("replicas", [])}
        except TRANSIENT:
            actions = {}
        rows = server_rows(run)
        if sorted(actions.values()) == ["drain", "serve"] and \
                sorted(r["status"].split()[0] for r in rows) == ["DOWN", "UP"]:
            break
        time.sleep(1)
    assert sorted(actions.values()) == ["drain", "serve"], actions
    status = {r["svname"]: r["status"] for r in rows}
    assert sorted(s.split()[0] for s in status.values()) == ["DOWN", "UP"], status
    [down] = [r for r in rows if r["status"].startswith("DOWN")]
    # Layer-7 check failed on the status: the 503 of our gate (or Serve's own shutdown/
    # engine answer, which the report rules out: the replica is drained, not stopping).
    assert down["check_status"] == "L7STS" and down["check_code"] == "503", down
    before = {r["svname"]: int(r["stot"]) for r in rows}
    for _ in range(6):
        assert chat(2).status_code == 200
    after = {r["svname"]: int(r["stot"]) for r in server_rows(run)}
    assert after[down["svname"]] == before[down["svname"]], (before, after)
    assert sum(after.values()) - sum(before.values()) >= 6, (before, after)


def test_sigterm_stops_everything_haproxy_included(run: mn.Run) -> None:
    pids = run.all_pids()
    code, rest, seconds = mn.stop_run(run)
    print(f"stopped in {seconds:.1f} s")
    assert code == 0, rest[-4000:]
    deadline = time.monotonic() + 30
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(1)
    assert not alive(pids), f"left after dsv4-serve run stopped: {alive(pids)}"
