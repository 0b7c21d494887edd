"""Faults on the fleet store, at the store level (issue 52): real servers, real store
classes, vLLM's real ``OpenAIServingResponses`` bound to them (its create stood in by
what vLLM's does for a stored request: input messages and the response into its dicts).

Redis killed mid-conversation: a 503 naming the store, nothing half-written, follow-ups
work again once it is back (the server keeps an append-only file, as a fleet's would);
SQLite locked by another process: a 503 naming it, nothing written.
"""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from deployments.responses.binding import StoreBinding
from deployments.responses.redis_store import RedisStore
from deployments.responses.sqlite import SQLiteStore
from deployments.responses.store import Quota, ResponsesStore
from tests.support import redis_server as redis_support
from tests.support.responses_stores import A
from tests.support.responses_stores import as_owner as _as
from tests.support.responses_stores import replica as _replica
from tests.support.responses_stores import response as _response


def _conversing(store: ResponsesStore) -> StoreBinding:
    binding = _replica(store)

    async def create(request: Any, raw_request: Any = None) -> Any:
        serving = binding.serving
        before = serving.msg_store.get(request.previous_response_id) or [] \
            if request.previous_response_id else []
        serving.msg_store[request.request_id] = [*before, {"role": "user",
                                                           "content": request.input}]
        serving.response_store[request.request_id] = _response(request.request_id,
                                                               "completed")
        return serving.response_store[request.request_id]
    binding._create = create
    return binding


def _turn(binding: StoreBinding, rid: str, previous: str | None) -> Any:
    request = SimpleNamespace(request_id=rid, previous_response_id=previous,
                              background=False, stream=False, input=f"turn {rid}")
    return _as(A, binding.create(request))


class _AofRedis:
    """A redis-server with an append-only file (fsync always): killed, it comes back
    with what it acknowledged."""

    def __init__(self, exe: str, workdir: Path) -> None:
        self.exe, self.workdir = exe, workdir
        self.port = redis_support.free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "yes", "--appendfsync", "always",
             "--requirepass", redis_support.PASSWORD, "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                time.sleep(0.2)  # the AOF is loaded before commands are served
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not come up")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)
        self.proc = None


def test_redis_killed_mid_conversation(tmp_path: Path) -> None:
    exe = redis_support.binary()
    if exe is None:
        pytest.skip("no redis-server (make setup installs it)")
    server = _AofRedis(exe, tmp_path)
    server.start()

    async def body() -> None:
        store = RedisStore(f"redis://127.0.0.1:{server.port}/0", redis_support.PASSWORD,
                           "faults", Quota(3600, 100), 0.5)
        binding = _conversing(store)
        try:
            first = await _turn(binding, "resp_1", None)
            assert first.status == "completed"
            server.kill()
            for rid, previous in (("resp_2", "resp_1"), ("resp_2b", None)):
                down = await _turn(binding, rid, previous)
                assert down.error.code == 503, down
                assert "Redis Responses store" in down.error.message
                assert "nothing was stored" in down.error.message
            server.start()
            assert await store.get(A, "resp_2b") is None  # nothing half-written
            assert await store.get(A, "resp_2") is None
            again = await _turn(binding, "resp_3", "resp_1")  # the follow-up works again
            assert again.status == "completed"
            record = await store.get(A, "resp_3")
            assert record is not None and "turn resp_1" in (record.messages or "")
            assert len(binding.messages) == 0 and len(binding.responses) == 0
        finally:
            await store.close()
            if server.proc is not None:
                server.kill()
    asyncio.run(body())


def test_sqlite_locked_by_another_process_is_a_503(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")
        held.set()
        release.wait(10)
        other.execute("ROLLBACK")
        other.close()

    async def body() -> None:
        store = SQLiteStore(path, Quota(3600, 100), 0.5)
        await store.size()  # the schema exists before the lock
        binding = _conversing(store)
        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(5)
        try:
            down = await _turn(binding, "resp_1", None)
            assert down.error.code == 503 and "SQLite Responses store" in down.error.message
        finally:
            release.set()
            holder.join()
        assert await store.get(A, "resp_1") is None
        assert (await _turn(binding, "resp_2", None)).status == "completed"
        await store.close()
    asyncio.run(body())


def test_the_store_503_reaches_the_client_through_the_edge_scrub() -> None:
    """The edge scrubs every 5xx to a request id; a store failure's 503 names the store
    and the fix (nothing internal), so it goes out as written (live: the 2-node run)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from deployments.http.scrub import ScrubMiddleware
    from deployments.responses.views import OwnerScope, mark_store_error_public

    said = "the Responses store is unavailable (the Redis Responses store could not read)"

    async def failing(request: Request) -> JSONResponse:
        if request.query_params.get("store") == "1":
            mark_store_error_public()
        return JSONResponse({"error": {"message": said, "code": 503}}, status_code=503)

    inner: Any = OwnerScope(Starlette(routes=[Route("/v1/responses", failing)]))
    app = ScrubMiddleware(inner)
    client = TestClient(app)
    public = client.get("/v1/responses?store=1")
    assert public.status_code == 503 and public.json()["error"]["message"] == said
    other = client.get("/v1/responses")  # any other 5xx is still scrubbed
    assert other.status_code == 503 and "Redis" not in other.text
