"""``dsv4-haproxy`` on the config Ray 2.60 itself renders: the stats page and the
Prometheus exporter bind 127.0.0.1, the admin socket is mode 600, HAProxy accepts the
result, and a config without those lines is refused rather than started open."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from deployments import serve_env
from deployments.doors import haproxy
from deployments.harness.haproxy_config import app_backend, ray_rendered_config


def test_replica_servers_move_to_their_own_ports_and_nothing_else_does(
        tmp_path: Path) -> None:
    env = {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "30000",
           "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "31000"}
    text = ray_rendered_config(tmp_path, backends=app_backend([30000, 30999]))
    assert "10.0.0.7:30000 check" in text and "10.0.0.7:30999 check" in text
    out = haproxy.harden(text, env)
    servers = [ln.split()[1:3] for ln in out.text.splitlines()
               if ln.strip().startswith("server ")]
    assert servers == [["replica-0", "10.0.0.7:31000"], ["replica-1", "10.0.0.7:31999"],
                       ["fallback", "10.0.0.1:8500"]], servers
    assert sum("replica-" in change for change in out.changes) == 2, out.changes
    # The rest of each server line (check, observe, backup) is kept as Ray wrote it.
    before = {ln.split()[1]: ln.split()[3:] for ln in text.splitlines()
              if ln.strip().startswith("server ")}
    after = {ln.split()[1]: ln.split()[3:] for ln in out.text.splitlines()
             if ln.strip().startswith("server ")}
    assert before == after
    # A port just outside Ray's range (MAX itself is never handed out) stays.
    edge = haproxy.harden(ray_rendered_config(tmp_path, backends=app_backend([31000])), env)
    assert "10.0.0.7:31000 check" in edge.text and len(edge.changes) == 3


def test_a_broken_direct_ingress_range_is_named() -> None:
    from deployments import serve_env

    with pytest.raises(ValueError, match="RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"):
        serve_env.direct_ingress_range({"RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "x"})
    with pytest.raises(ValueError, match="MIN < MAX"):
        serve_env.direct_ingress_range({"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "31000",
                                        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "30000"})
    with pytest.raises(ValueError, match="65536"):
        serve_env.direct_ingress_range({"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "40000",
                                        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "60000"})


def test_the_range_defaults_are_the_installed_rays(monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    from ray.serve._private import constants

    from deployments import serve_env

    for flag in serve_env.DIRECT_RANGE_FLAGS:
        monkeypatch.delenv(flag, raising=False)
    assert serve_env.direct_ingress_range() == serve_env.DIRECT_RANGE_DEFAULTS
    source = inspect.getsource(constants)
    for flag, default in zip(serve_env.DIRECT_RANGE_FLAGS, serve_env.DIRECT_RANGE_DEFAULTS,
                             strict=True):
        assert f'"{flag}", "{default}"' in source, f"Ray's default for {flag} changed"


def test_ray_template_binds_every_interface_and_we_close_it(tmp_path: Path) -> None:
    text = ray_rendered_config(tmp_path)
    assert "bind *:8404" in text and "bind :9101" in text and "mode 666" in text
    out = haproxy.harden(text)
    assert "bind 127.0.0.1:8404" in out.text and "bind 127.0.0.1:9101" in out.text
    assert "bind *:" not in out.text and "bind :" not in out.text
    assert "mode 600 level admin" in out.text and "mode 666" not in out.text
    assert len(out.changes) == 3
    # The API frontend keeps http_options.host: only the side doors move.
    assert "bind 127.0.0.1:8000" in out.text


@pytest.mark.parametrize("ports", [[], [30000, 30001]])
@pytest.mark.parametrize("balance", ["leastconn", "session"])
def test_haproxy_accepts_the_hardened_config(tmp_path: Path, ports: list[int],
                                             balance: str) -> None:
    """Also with session affinity (serve_env.HAPROXY_TUNING's balance, which Ray renders
    as given: set here on the text, Ray reads its env once at import)."""
    target = tmp_path / "hardened.cfg"
    text = ray_rendered_config(tmp_path, backends=app_backend(ports) if ports else None)
    assert "balance leastconn" in text
    if balance == "session":
        algorithm = serve_env.HAPROXY_TUNING["RAY_SERVE_HAPROXY_BALANCE_ALGORITHM"]
        text = text.replace("balance leastconn", f"balance {algorithm}")
    hardened = haproxy.harden(text).text
    assert ("hash-type consistent" in hardened) is (balance == "session")
    assert ("hash-balance-factor 150" in hardened) is (balance == "session")
    target.write_text(hardened)
    (tmp_path / "500.http").write_text("HTTP/1.0 500 Internal Server Error\r\n\r\n")
    real = haproxy.real_binary()
    check = subprocess.run([real, "-c", "-f", str(target)], capture_output=True, text=True,
                           timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("drop", ["listen stats", "frontend prometheus", "stats socket"])
def test_a_changed_template_is_refused_by_name(tmp_path: Path, drop: str) -> None:
    lines = ray_rendered_config(tmp_path).splitlines()
    if drop == "stats socket":
        kept = [ln for ln in lines if "stats socket" not in ln]
    else:  # the section's bind line changes shape (e.g. a host Ray now takes)
        start = lines.index(drop)
        kept = lines[:start + 1] + [ln.replace("bind", "bind-process") if "bind" in ln
                                     else ln for ln in lines[start + 1:start + 3]] \
            + lines[start + 3:]
    with pytest.raises(haproxy.HAProxyConfigError, match=drop):
        haproxy.harden("\n".join(kept))


def test_the_real_binary_is_never_the_wrapper(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    wrapper = Path(__import__("sys").executable).with_name("dsv4-haproxy")
    monkeypatch.setenv(haproxy.BINARY_FLAG, str(wrapper))
    found = haproxy.real_binary()
    assert Path(found).name == "haproxy" and Path(found) != wrapper
    assert os.environ[haproxy.BINARY_FLAG] == str(wrapper)  # put back for Ray
    link = tmp_path / "haproxy"
    link.symlink_to(wrapper)
    with pytest.raises(ValueError, match="this wrapper"):
        haproxy.real_binary({haproxy.ENV_REAL_BINARY: str(link)})


def test_wrapper_needs_a_config_argument() -> None:
    assert haproxy.main(["-db"]) == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_wrapper_execs_haproxy_with_loopback_side_doors(tmp_path: Path) -> None:
    """The real wrapper, the real binary: what it listens on, read from the kernel."""
    stats, metrics = _free_port(), _free_port()
    text = ray_rendered_config(tmp_path, stats, metrics).replace(
        "bind 127.0.0.1:8000", f"bind 127.0.0.1:{_free_port()}")
    (tmp_path / "500.http").write_text("HTTP/1.0 500 Internal Server Error\r\n\r\n")
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(text)
    exe = Path(__import__("sys").executable).with_name("dsv4-haproxy")
    assert exe.exists(), "pip install -e . provides the dsv4-haproxy entry point"
    # As Ray runs it: RAY_SERVE_HAPROXY_BINARY_PATH names the wrapper itself.
    proc = subprocess.Popen([str(exe), "-db", "-f", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env=os.environ | {haproxy.BINARY_FLAG: str(exe)})
    try:
        want = {stats, metrics}
        seen: dict[int, str] = {}
        end = time.monotonic() + 20
        while time.monotonic() < end and set(seen) != want and proc.poll() is None:
            for conn in psutil.Process(proc.pid).net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port in want:
                    seen[conn.laddr.port] = conn.laddr.ip
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate(timeout=5)
        assert seen == {stats: "127.0.0.1", metrics: "127.0.0.1"}
        assert oct((tmp_path / "admin.sock").stat().st_mode & 0o777) == "0o600"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_haproxy_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    """Ray's HAProxy manager stops HAProxy only on a graceful shutdown; killed hard, it
    used to leave HAProxy holding the door's port (seen: a benchmark's next arm could
    not bind it). Under dsv4-haproxy HAProxy gets SIGTERM when its parent dies."""
    import signal
    import sys

    text = ray_rendered_config(tmp_path, _free_port(), _free_port()).replace(
        "bind 127.0.0.1:8000", f"bind 127.0.0.1:{_free_port()}")
    (tmp_path / "500.http").write_text("HTTP/1.0 500 Internal Server Error\r\n\r\n")
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(text)
    exe = Path(sys.executable).with_name("dsv4-haproxy")
    # The parent, as Ray's manager is: it starts the wrapper and stays until killed.
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         f"p = subprocess.Popen([{str(exe)!r}, '-db', '-f', {str(cfg)!r}])\n"
         "print(p.pid, flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
        env=os.environ | {haproxy.BINARY_FLAG: str(exe)})
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        end = time.monotonic() + 20  # until the wrapper has exec'd HAProxy
        while time.monotonic() < end and Path(child.cmdline()[0]).name != "haproxy":
            time.sleep(0.2)
        assert Path(child.cmdline()[0]).name == "haproxy", child.cmdline()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        gone, _ = psutil.wait_procs([child], timeout=10)
        assert gone, f"HAProxy {child.pid} outlived the process that started it"
    finally:
        if child.is_running():
            child.kill()


def test_target_ray_keeps_haproxy_on_rays_ports_and_a_bad_target_is_named(
        tmp_path: Path) -> None:
    from deployments import serve_env

    text = ray_rendered_config(tmp_path, backends=app_backend([30000]))
    kept = haproxy.harden(text, {serve_env.HAPROXY_TARGET_FLAG: "ray"})
    assert "10.0.0.7:30000 check" in kept.text and len(kept.changes) == 3
    with pytest.raises(ValueError, match=serve_env.HAPROXY_TARGET_FLAG):
        haproxy.harden(text, {serve_env.HAPROXY_TARGET_FLAG: "proxy"})
    problem = serve_env.ingress_problem("haproxy", {
        serve_env.HAPROXY_FLAG: "1", serve_env.HAPROXY_BINARY_FLAG: "/x/dsv4-haproxy",
        serve_env.HAPROXY_TARGET_FLAG: "proxy"})
    assert problem is not None and "expected one of replica, ray" in problem
