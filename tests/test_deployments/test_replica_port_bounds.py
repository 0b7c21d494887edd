"""The replicas' own port: no wait without a deadline, a connection cap, a shutdown that
closes the port at once and ends held streams with an error event, a dead engine's
share closed, one server per replica however ``resume`` races.

Real uvicorn servers on real loopback sockets (``deployments.doors.listener``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import pytest

from deployments.config.http import ReplicaPortLimits
from deployments.doors import listener as listener_module
from deployments.doors.listener import ReplicaListener, listeners_on
from tests.support.replica_port import (
    closed_within,
    fastapi_stream_app,
    free_port,
    get,
    get_response,
    in_thread,
    named_app,
)

QUICK = ReplicaPortLimits(header_timeout_s=0.5, idle_timeout_s=1, max_connections=8)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=2.0)


def test_silent_and_trickling_connections_are_closed_within_the_header_deadline() -> None:
    async def scenario() -> None:
        port = free_port()
        listener = ReplicaListener(named_app("a"), "127.0.0.1", port, QUICK)
        await listener.start()
        silent = [connect(port) for _ in range(5)]
        trickle = connect(port)
        started = time.monotonic()
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\n":  # never the blank line
            try:
                trickle.send(bytes([byte]))
            except OSError:
                break
            await asyncio.sleep(0.05)
        for sock in [*silent, trickle]:
            assert await in_thread(closed_within, sock, 2.0) == b""
            sock.close()
        assert time.monotonic() - started < 3.0
        # A client that sends its headers in time is served, and a kept-alive idle
        # connection closes after idle_timeout_s.
        assert await in_thread(get, port) == "a"
        kept = connect(port)
        kept.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.2)
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        assert await in_thread(closed_within, kept, 3.0) == b""
        kept.close()
        await listener.stop(1.0)

    asyncio.run(scenario())


def test_the_connection_over_the_cap_gets_a_503_and_is_closed() -> None:
    async def scenario() -> None:
        port = free_port()
        limits = ReplicaPortLimits(header_timeout_s=30, max_connections=4)
        listener = ReplicaListener(named_app("a"), "127.0.0.1", port, limits)
        await listener.start()
        held = [connect(port) for _ in range(4)]
        await asyncio.sleep(0.2)
        over = connect(port)
        answer = await in_thread(closed_within, over, 2.0)
        assert answer is not None and answer.startswith(b"HTTP/1.1 503"), answer
        over.close()
        for sock in held:
            sock.close()
        await asyncio.sleep(0.2)
        assert await in_thread(get, port) == "a"  # a slot is free again
        await listener.stop(1.0)

    asyncio.run(scenario())


def test_headers_larger_than_the_bound_get_431() -> None:
    async def scenario() -> None:
        port = free_port()
        listener = ReplicaListener(named_app("a"), "127.0.0.1", port, QUICK)
        await listener.start()
        sock = connect(port)
        padding = b"x-pad: " + b"p" * 1000 + b"\r\n"
        try:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n" + padding * 80)
        except OSError:
            pass
        answer = await in_thread(closed_within, sock, 2.0)
        assert answer is not None and answer.startswith(b"HTTP/1.1 431"), answer
        sock.close()
        await listener.stop(1.0)

    asyncio.run(scenario())


def test_concurrent_resumes_bind_one_server_and_flapping_keeps_no_backlog() -> None:
    async def scenario() -> None:
        port = free_port()
        listener = ReplicaListener(named_app("a"), "127.0.0.1", port)
        await listener.start()
        for _ in range(10):
            listener.pause()
            await asyncio.gather(listener.resume(), listener.resume(), listener.resume())
        assert len(listeners_on(port)) == 1
        await asyncio.sleep(0.5)
        assert listener.closing == 0
        assert await in_thread(get, port) == "a"
        await listener.stop(1.0)
        assert listeners_on(port) == set()

    asyncio.run(scenario())


def test_a_start_timeout_closes_the_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listener_module, "START_TIMEOUT_S", -1.0)

    async def scenario() -> None:
        port = free_port()
        listener = ReplicaListener(named_app("a"), "127.0.0.1", port)
        with pytest.raises(RuntimeError, match="did not start within"):
            await listener.start()
        await asyncio.sleep(0.2)
        assert listeners_on(port) == set()
        with socket.socket() as plain:  # no SO_REUSEPORT: fails while ours is bound
            plain.bind(("127.0.0.1", port))

    asyncio.run(scenario())


def test_the_last_listener_on_the_port_knows_it_is_the_last() -> None:
    async def scenario() -> None:
        port = free_port()
        a = ReplicaListener(named_app("a"), "127.0.0.1", port)
        b = ReplicaListener(named_app("b"), "127.0.0.1", port)
        await a.start()
        await b.start()
        assert a.others_listening() and b.others_listening()
        b.pause()
        await asyncio.sleep(0.3)
        assert not a.others_listening()
        await a.stop(1.0)
        await b.stop(1.0)

    asyncio.run(scenario())


def test_a_dead_engine_closes_its_share_and_a_drain_lift_does_not_reopen_it() -> None:
    async def scenario() -> None:
        port = free_port()
        a = ReplicaListener(named_app("a"), "127.0.0.1", port)
        b = ReplicaListener(named_app("b"), "127.0.0.1", port)
        await a.start()
        await b.start()
        a.engine_dead()
        await a.resume()  # the verdict says "serve": the engine is still dead
        await asyncio.sleep(0.2)
        assert not a.listening
        assert {await in_thread(get, port) for _ in range(20)} == {"b"}
        await a.stop(1.0)
        await b.stop(1.0)

    asyncio.run(scenario())


def test_serve_stopping_the_replica_closes_the_port_at_once() -> None:
    async def scenario() -> None:
        port = free_port()
        hold = asyncio.Event()
        listener = ReplicaListener(named_app("a", hold), "127.0.0.1", port)
        await listener.start()
        stopping = [False]
        listener.watch(lambda: stopping[0], budget_s=30.0, poll_s=0.05)
        slow = asyncio.ensure_future(in_thread(get, port, "/slow", 10.0))
        await asyncio.sleep(0.3)
        stopping[0] = True
        await asyncio.sleep(0.3)  # long before __del__ (``stop``)
        assert not listener.listening
        with pytest.raises(OSError):
            await in_thread(get, port, "/", 1.0)
        hold.set()
        assert await slow == "start a"  # the held stream finished
        await listener.stop(30.0)

    asyncio.run(scenario())


@pytest.mark.parametrize("path, app, expect", [
    ("/slow", "plain", 'start data: {"error": {"message": "this replica is shutting'),
    ("/v1/messages", "plain", 'start event: error\ndata: {"type": "error"'),
    ("/v1/chat/completions", "fastapi",
     'data: {"choices": []}\n\ndata: {"error": {"message": "this replica is shutting'),
])
def test_streams_held_past_the_budget_end_with_an_error_event(
        path: str, app: str, expect: str) -> None:
    async def scenario() -> None:
        port = free_port()
        hold = asyncio.Event()
        asgi = fastapi_stream_app(hold) if app == "fastapi" else \
            named_app("a", hold, b"text/event-stream")
        listener = ReplicaListener(asgi, "127.0.0.1", port)
        await listener.start()
        stream = asyncio.ensure_future(in_thread(get_response, port, path))
        late = asyncio.ensure_future(in_thread(get_response, port, "/late"))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await listener.stop(listener_module.CUT_MARGIN_S + 0.5)
        assert time.monotonic() - started < listener_module.CUT_MARGIN_S + 2.0
        status, body = await stream  # read to the chunked body's clean end
        assert status == 200 and body.startswith(expect), body
        status, body = await late
        assert status == 503 and json.loads(body)["error"]["code"] == 503

    asyncio.run(scenario())


# --------------------------------------- the replica's side (deployments.serving.server)


def replica_on(listener: ReplicaListener, check_health: Any = None) -> Any:
    """A ``DSv4ServerMixin`` around ``listener``; its engine base is a stand-in whose
    ``check_health`` is ``check_health`` (what LLMServer's raises for a dead engine)."""
    from deployments.config import DSv4Section, HTTPEdge
    from deployments.control.wire import ReplicaVerdict
    from deployments.doors.lifecycle import Doors
    from deployments.serving.server import DSv4ServerMixin

    class Engine:
        async def check_health(self) -> None:
            if check_health is not None:
                check_health()

    class Replica(DSv4ServerMixin, Engine):
        pass

    replica: Any = object.__new__(Replica)
    replica._edge, replica._verdict, replica._replica_id = None, ReplicaVerdict(), "r0"
    replica._http = HTTPEdge(replica_port=listener.port)  # the replica port, not HAProxy
    replica._doors = Doors(replica._http, answers_http=True, drain_timeout_s=1.0)
    replica._doors.listener = listener
    replica._settings = DSv4Section.model_validate({"policy": "drain"})
    return replica


def test_a_replica_whose_engine_died_closes_its_share_of_the_port() -> None:
    def dead() -> None:
        raise RuntimeError("EngineCore died (EngineDeadError)")

    async def scenario() -> None:
        port = free_port()
        a = ReplicaListener(named_app("a"), "127.0.0.1", port)
        b = ReplicaListener(named_app("b"), "127.0.0.1", port)
        await a.start()
        await b.start()
        with pytest.raises(RuntimeError, match="EngineCore died"):
            await replica_on(a, dead).check_health()
        assert not a.listening
        assert {await in_thread(get, port) for _ in range(20)} == {"b"}
        await a.stop(1.0)
        await b.stop(1.0)

    asyncio.run(scenario())


def test_a_drained_replica_keeps_the_port_when_it_is_the_last_on_its_node() -> None:
    from deployments.control.wire import Action, ReplicaVerdict, VerdictMessage

    odd = ReplicaVerdict(odd=True, reason="differs", action=Action.DRAIN, attempts=1)
    # r1 serves, but on another node: nothing else listens on this node's port.
    message = VerdictMessage(checked_at=1.0, replicas={"r0": odd, "r1": ReplicaVerdict()})

    async def scenario() -> None:
        port = free_port()
        a = ReplicaListener(named_app("a"), "127.0.0.1", port)
        await a.start()
        replica = replica_on(a)
        await replica.apply_kv_verdict(message.model_dump(mode="json"))
        assert a.listening and await in_thread(get, port) == "a"
        # A second replica on this node: now the drained one steps aside.
        b = ReplicaListener(named_app("b"), "127.0.0.1", port)
        await b.start()
        await replica.apply_kv_verdict(message.model_copy(
            update={"checked_at": 2.0}).model_dump(mode="json"))
        assert not a.listening
        await a.stop(1.0)
        await b.stop(1.0)

    asyncio.run(scenario())


def test_a_body_after_an_early_answer_is_not_counted_as_headers() -> None:
    """The edge answers 413 before it reads a too-large body; the body still arriving on
    that connection is body, not the next request's headers (no 431 on top)."""

    async def early(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"too large"})

    async def scenario() -> None:
        port = free_port()
        listener = ReplicaListener(early, "127.0.0.1", port, QUICK)
        await listener.start()
        body = b"x" * (3 << 20)

        def post() -> bytes:
            with connect(port) as sock:
                sock.settimeout(5.0)
                sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n"
                             + f"Content-Length: {len(body)}\r\n\r\n".encode())
                sock.sendall(body)
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answers = b""
                while chunk := sock.recv(65536):
                    answers += chunk
                return answers

        answers = await in_thread(post)
        assert b" 431 " not in answers, answers
        # Both the upload and the next request on the connection got the app's answer.
        assert answers.count(b"HTTP/1.1 413") == 2, answers
        await listener.stop(1.0)

    asyncio.run(scenario())
