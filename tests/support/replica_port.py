"""Helpers for tests of the replicas' own port (``deployments.doors.listener``): real
uvicorn servers on real loopback sockets, driven from the test's event loop."""

from __future__ import annotations

import asyncio
import http.client
import socket
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def named_app(name: str, hold: asyncio.Event | None = None,
              content_type: bytes = b"text/plain") -> Any:
    """An ASGI app that answers its name; ``/slow`` (or ``/v1/messages``) streams a first
    chunk, then waits for ``hold``; ``/late`` waits for ``hold`` before it answers."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        if scope["path"] == "/late" and hold is not None:
            await hold.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type)]})
        if scope["path"] in ("/slow", "/v1/messages") and hold is not None:
            await send({"type": "http.response.body", "body": b"start ",
                        "more_body": True})
            await hold.wait()
        await send({"type": "http.response.body", "body": name.encode()})

    return app


def fastapi_stream_app(hold: asyncio.Event) -> Any:
    """vLLM's shape of a stream: FastAPI's ``StreamingResponse`` (anyio task group) of
    SSE events on ``/v1/chat/completions``, one event, then waiting for ``hold``;
    ``/late`` answers only after ``hold``."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    async def events() -> Any:
        yield 'data: {"choices": []}\n\n'
        await hold.wait()
        yield "data: [DONE]\n\n"

    async def chat() -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    async def late() -> dict[str, str]:
        await hold.wait()
        return {}

    app.add_api_route("/v1/chat/completions", chat, methods=["GET"])
    app.add_api_route("/late", late, methods=["GET"])
    return app


def get(port: int, path: str = "/", timeout: float = 5.0) -> str:
    """One request on a fresh connection (so the kernel picks a listener each time)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def get_response(port: int, path: str, timeout: float = 10.0) -> tuple[int, str]:
    """Status and the whole body of one request (the body read to its clean end)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before it closed ``sock`` within ``seconds``; None if open."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return got


async def in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
