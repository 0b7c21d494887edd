"""The replica's own HTTP door (``deployments.doors.listener``) and its config rules.

Real uvicorn servers on real loopback sockets, two "replicas" sharing one port; the
live stack (tests/conftest.py) serves every other test through the same door.
"""

from __future__ import annotations

import asyncio
import copy
import http.client
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments.config import DEFAULT_CONFIG, ConfigError, load_serve_config
from deployments.doors.listener import ReplicaListener, reuse_port_socket
from deployments.local.deploy import base_url, refuse_busy_ports
from tests.support.replica_port import free_port, get, in_thread, named_app


def test_replicas_share_one_port_and_a_paused_one_gets_no_connections() -> None:
    async def scenario() -> None:
        port = free_port()
        a = ReplicaListener(named_app("a"), "127.0.0.1", port)
        b = ReplicaListener(named_app("b"), "127.0.0.1", port)
        await a.start()
        await b.start()
        seen = [await in_thread(get, port) for _ in range(40)]
        # The kernel spreads new connections over both (hash of the client port).
        assert set(seen) == {"a", "b"}, seen
        a.pause()
        assert not a.listening
        await asyncio.sleep(0.2)
        assert {await in_thread(get, port) for _ in range(20)} == {"b"}
        await a.resume()
        assert a.listening
        assert "a" in {await in_thread(get, port) for _ in range(40)}
        await a.stop(5.0)
        await b.stop(5.0)
        with pytest.raises(OSError):
            await in_thread(get, port, "/", 1.0)

    asyncio.run(scenario())


def test_stop_lets_a_held_stream_finish_and_refuses_new_connections() -> None:
    async def scenario() -> None:
        port = free_port()
        hold = asyncio.Event()
        listener = ReplicaListener(named_app("a", hold), "127.0.0.1", port)
        await listener.start()
        slow = asyncio.ensure_future(in_thread(get, port, "/slow", 10.0))
        await asyncio.sleep(0.3)  # the stream has started
        stopping = asyncio.ensure_future(listener.stop(10.0))
        await asyncio.sleep(0.3)
        assert not stopping.done()  # waiting for the held request
        with pytest.raises(OSError):
            await in_thread(get, port, "/", 1.0)
        hold.set()
        assert await slow == "start a"
        await asyncio.wait_for(stopping, 5.0)

    asyncio.run(scenario())


def test_stop_cuts_what_outlives_the_grace_period() -> None:
    async def scenario() -> None:
        port = free_port()
        listener = ReplicaListener(named_app("a", asyncio.Event()), "127.0.0.1", port)
        await listener.start()
        slow = asyncio.ensure_future(in_thread(get, port, "/slow", 10.0))
        await asyncio.sleep(0.3)
        started = asyncio.get_running_loop().time()
        await listener.stop(0.5)
        assert asyncio.get_running_loop().time() - started < 7.0
        with pytest.raises((OSError, http.client.HTTPException)):
            await slow

    asyncio.run(scenario())


def test_a_port_held_without_reuseport_is_refused_with_the_fix() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port} for "
                                          "http.replica_port.*Fix: free the port"):
            reuse_port_socket("127.0.0.1", port)


def local_raw() -> dict[str, Any]:
    return yaml.safe_load(Path(DEFAULT_CONFIG).read_text())


def write(tmp_path: Path, raw: dict[str, Any]) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_local_default_answers_on_the_replicas_port() -> None:
    config = load_serve_config(DEFAULT_CONFIG)
    [(app, port)] = config.replica_ports()
    assert port == 8000 and config.http_options.port == 8500
    assert base_url(config, app.route_prefix) == "http://127.0.0.1:8000/v1"
    # Without replica_port, the proxy's port.
    raw = local_raw()
    del raw["applications"][0]["args"]["http"]["replica_port"]
    assert base_url(type(config).model_validate(raw), "/") == "http://127.0.0.1:8500/v1"


@pytest.mark.parametrize("change, message", [
    (lambda r: r["http_options"].update(port=8000), "is http_options.port"),
    (lambda r: r["applications"][0].update(route_prefix="/x"), "route_prefix '/x'"),
    (lambda r: r["applications"][0]["args"]["llm"]["deployment_config"][
        "autoscaling_config"].update(max_replicas=3), "invisible to Serve's autoscaler"),
    (lambda r: r["applications"].append(dict(
        copy.deepcopy(r["applications"][0]), name="two", route_prefix="/two")),
     "also applications\\[dsv4\\]'s"),
])
def test_replica_port_rules_name_the_field_and_the_fix(tmp_path: Path, change: Any,
                                                       message: str) -> None:
    raw = local_raw()
    change(raw)
    with pytest.raises(ConfigError, match=message) as info:
        load_serve_config(write(tmp_path, raw))
    assert "replica_port" in str(info.value) and "Fix:" in str(info.value)


def test_run_refuses_a_port_something_already_answers_on() -> None:
    config = load_serve_config(DEFAULT_CONFIG)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config.http_options.port = port
        with pytest.raises(ConfigError, match=f"http_options.port={port}: something "
                                              "already answers"):
            refuse_busy_ports(config)


def test_free_ports_pass(tmp_path: Path) -> None:
    raw = local_raw()
    raw["http_options"]["port"] = free_port()
    raw["applications"][0]["args"]["http"]["replica_port"] = free_port()
    refuse_busy_ports(load_serve_config(write(tmp_path, raw)))


def test_behind_haproxy_health_is_serves_answer_and_every_request_is_counted() -> None:
    """The port HAProxy reaches: ``/-/healthz`` (no key) answers what Serve's data-plane
    health says; every other request is counted in while held, out however it ends."""
    from deployments.doors.behind_haproxy import HEALTH_PATH, BehindHAProxy
    from tests.support.replica_port import get_response

    async def scenario() -> None:
        port = free_port()
        hold = asyncio.Event()
        answer = [(True, "success")]
        counted: list[int] = []

        async def health() -> tuple[bool, str]:
            return answer[0]

        app = BehindHAProxy(named_app("a", hold), health, counted.append)
        listener = ReplicaListener(app, "127.0.0.1", port, shared=False)
        await listener.start()
        assert await in_thread(get_response, port, HEALTH_PATH) == (200, "success")
        answer[0] = (False, "DRAINED by the dsv4 KV-spec check")
        assert await in_thread(get_response, port, HEALTH_PATH) == (
            503, "DRAINED by the dsv4 KV-spec check")
        assert counted == []  # health checks are not load
        slow = asyncio.ensure_future(in_thread(get, port, "/slow", 10.0))
        await asyncio.sleep(0.3)
        assert counted == [1]
        hold.set()
        assert await slow == "start a"
        await asyncio.sleep(0.1)
        assert counted == [1, -1]
        # A request cut at the end of the shutdown budget is counted out too.
        cut = asyncio.ensure_future(in_thread(get, port, "/slow", 10.0))
        hold.clear()
        await asyncio.sleep(0.3)
        await listener.stop(0.1)
        with pytest.raises((OSError, http.client.HTTPException)):
            await cut
        assert sum(counted) == 0 and len(counted) == 4

    asyncio.run(scenario())


def test_a_watched_stop_keeps_answering_through_the_hold_then_closes() -> None:
    """Behind a balancer the port answers while Serve's health check fails (the hold),
    so requests the balancer still sends are served; then it closes."""
    async def scenario() -> None:
        port = free_port()
        stopping = [False]
        listener = ReplicaListener(named_app("a"), "127.0.0.1", port, shared=False)
        await listener.start()
        listener.watch(lambda: stopping[0], budget_s=10.0, poll_s=0.05, hold_s=1.0)
        stopping[0] = True
        await asyncio.sleep(0.4)
        assert await in_thread(get, port) == "a"  # within the hold
        await asyncio.sleep(1.2)
        assert not listener.listening
        with pytest.raises(OSError):
            await in_thread(get, port, "/", 1.0)
        await listener.stop(1.0)

    asyncio.run(scenario())


def test_behind_haproxy_mounts_the_app_at_its_route_prefix_as_serve_does() -> None:
    """HAProxy forwards the whole path: an app at ``/dsv4`` answers ``/dsv4/...`` as it
    would through Serve (FastAPI routes under ``root_path``); a path outside is a 404."""
    from fastapi import FastAPI

    from deployments.doors.behind_haproxy import HEALTH_PATH, BehindHAProxy
    from tests.support.replica_port import get_response

    api = FastAPI()

    @api.get("/v1/models")
    async def models() -> dict[str, str]:
        return {"object": "list"}

    async def scenario() -> None:
        port = free_port()

        async def health() -> tuple[bool, str]:
            return True, "success"

        counted: list[int] = []
        app = BehindHAProxy(api, health, counted.append, route_prefix="/dsv4")
        listener = ReplicaListener(app, "127.0.0.1", port, shared=False)
        await listener.start()
        status, body = await in_thread(get_response, port, "/dsv4/v1/models")
        assert (status, body) == (200, '{"object":"list"}')
        assert (await in_thread(get_response, port, "/v1/models"))[0] == 404
        assert (await in_thread(get_response, port, "/dsv4x/v1/models"))[0] == 404
        assert await in_thread(get_response, port, HEALTH_PATH) == (200, "success")
        assert counted == [1, -1]
        await listener.stop(1.0)

    asyncio.run(scenario())


@pytest.mark.parametrize("why", ["drain", "engine", "stop"])
def test_closed_while_starting_stays_closed(why: str) -> None:
    """The port closed while ``start()`` runs (drained, engine dead, stopping) must not
    open when uvicorn comes up: it once served until the next verdict."""
    async def scenario() -> None:
        port = free_port()
        listener = ReplicaListener(named_app("a"), "127.0.0.1", port)
        starting = asyncio.ensure_future(listener.start())
        while not listener._lock.locked():
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # inside the start: uvicorn is coming up
        listener.close_for(why)
        await starting
        assert not listener.listening
        await asyncio.sleep(0.2)
        with pytest.raises(OSError):
            await in_thread(get, port, "/", 1.0)
        await listener.stop(5.0)

    asyncio.run(scenario())
