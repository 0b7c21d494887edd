"""The edge's test harness: a FastAPI stand-in hardened as a replica hardens vLLM's app.

``build`` hardens it with ``front.harden`` (the whole edge stack) and stand-in routes on
the served paths; ``call`` drives one raw ASGI request, so each case runs in
milliseconds and can see what the app read, sent and when it was cancelled.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from deployments.config import HTTPEdge
from deployments.http.edge import Edge
from deployments.http.front import harden


class Probe:
    """What the stand-in routes saw."""

    def __init__(self) -> None:
        self.body_reads = 0
        self.cancelled = 0
        self.release = asyncio.Event()


def build(settings: HTTPEdge, probe: Probe, edge: Edge | None = None) -> FastAPI:
    """The stand-in app hardened with ``edge`` (default: ``settings`` on loopback, no key)."""
    edge = edge if edge is not None else guard(settings)
    app = harden(FastAPI(docs_url=None, redoc_url=None, openapi_url=None), edge)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        probe.body_reads += 1
        body = await request.json()
        mode = body.get("mode")
        if mode == "boom":
            raise RuntimeError("secret internal detail /opt/secret/path.py")
        if mode in ("five-hundred", "five-oh-three"):
            code = 500 if mode == "five-hundred" else 503
            return JSONResponse({"error": {"message": "engine died: secret", "code": code}},
                                status_code=code)
        if mode == "block":
            await probe.release.wait()
        if mode in ("stream", "stall", "stream-error"):
            return StreamingResponse(_events(mode, probe), media_type="text/event-stream")
        return {"choices": [], "n": body.get("n")}

    @app.post("/v1/chat/completions")
    @app.post("/v1/chat/completions/batch")
    @app.post("/v1/responses")
    @app.post("/v1/messages")
    async def chat(request: Request) -> Any:
        probe.body_reads += 1
        return {"choices": []}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"data": []}

    return app


async def _events(mode: str, probe: Probe) -> AsyncIterator[bytes]:
    try:
        yield b'data: {"choices": []}\n\n'
        if mode == "stream-error":
            yield b'data: {"error": {"message": "Traceback: /x/y.py secret", "code": 500}}\n\n'
            yield b"data: [DONE]\n\n"
            return
        if mode == "stall":
            await asyncio.sleep(30)
        yield b"data: [DONE]\n\n"
    except asyncio.CancelledError:
        probe.cancelled += 1
        raise


async def call(app: Any, method: str, path: str, body: bytes = b"",
               headers: dict[str, str] | None = None, chunks: list[bytes] | None = None,
               read_forbidden: bool = False,
               trickle: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One raw ASGI request; ``read_forbidden`` fails if anyone reads the body;
    ``trickle``: the last chunk promises more body, which never comes."""
    hdrs = {"content-type": "application/json", **(headers or {})}
    if chunks is None:
        chunks = [body]
        hdrs.setdefault("content-length", str(len(body)))
    scope = {"type": "http", "method": method, "path": path, "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in hdrs.items()],
             "query_string": b"", "http_version": "1.1", "scheme": "http",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000)}
    pending = list(chunks)
    out: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if read_forbidden:
            raise AssertionError("the body was read")
        if pending:
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk,
                    "more_body": bool(pending) or trickle}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        out.append(message)

    await asyncio.wait_for(app(scope, receive, send), timeout=20)
    start = next(m for m in out if m["type"] == "http.response.start")
    data = b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, data


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def guard(settings: HTTPEdge, host: str = "127.0.0.1", **env: str) -> Edge:
    """The edge a replica with ``settings`` bound to ``host`` builds (env: its keys)."""
    return Edge.start(settings, host, environ=env)


def error(data: bytes) -> dict[str, Any]:
    """The error object of an OpenAI (``{"error"}``) or Anthropic (``{"type": "error",
    "error"}``, on ``/v1/messages``) error body."""
    payload = json.loads(data)
    assert set(payload) in ({"error"}, {"type", "error"}), payload
    if "type" in payload:
        assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
    assert isinstance(payload["error"]["message"], str)
    return payload["error"]


def names(err: dict[str, Any], param: str) -> bool:
    """The error is about ``param``: OpenAI's ``param``, or (Anthropic's shape has no
    ``param``) its message starting with the field."""
    return err["param"] == param if "param" in err else param in err["message"]


def post(app: Any, body: dict[str, Any] | bytes, **kw: Any) -> tuple[int, dict[str, str], bytes]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return run(call(app, "POST", "/v1/completions", raw, **kw))


