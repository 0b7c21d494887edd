"""Both Responses store backends, for real: SQLite on a file, Redis on the session's server.

Owner isolation, the "stored cancel wins" write, eviction at the count and age bounds,
several processes on one SQLite file, and a Redis server killed mid-run then back.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deployments.config.responses import ResponsesStore as Settings
from deployments.responses import store as store_mod
from deployments.responses.open import open_store
from deployments.responses.redis_store import RedisStore
from deployments.responses.sqlite import SQLiteStore
from deployments.responses.store import Quota, StoreError, owner_of
from tests.support.redis_server import PASSWORD, RedisServer
from tests.support.responses_stores import A, B, make, redis_store, run

__all__ = ["make"]  # the fixture, both backends

def test_owner_digest_is_checked() -> None:
    assert owner_of(None) == store_mod.LOCAL_OWNER
    with pytest.raises(ValueError, match="SHA-256 hex"):
        owner_of("not-a-digest")


def test_round_trip_and_owner_isolation(make: Callable[..., Any]) -> None:
    async def body() -> None:
        s = make()
        try:
            await s.put_messages(A, "resp_1", '[{"role": "user", "content": "hi"}]')
            assert await s.put_response(A, "resp_1", '{"id": "resp_1"}', "completed")
            got = await s.get(A, "resp_1")
            assert got is not None and got.response == '{"id": "resp_1"}'
            assert got.messages == '[{"role": "user", "content": "hi"}]'
            assert got.status == "completed"
            # another key: exactly what a missing id gives
            assert await s.get(B, "resp_1") is None
            assert await s.get(A, "resp_missing") is None
            assert await s.statuses([(A, "resp_1"), (B, "resp_1")]) == {
                (A, "resp_1"): "completed"}
        finally:
            await s.close()
    run(body())


def test_a_stored_cancel_wins_over_the_running_replica(make: Callable[..., Any]) -> None:
    async def body() -> None:
        s = make()
        try:
            await s.put_response(A, "r", "{}", "queued")
            await s.put_response(A, "r", '{"c": 1}', "cancelled")
            assert not await s.put_response(A, "r", '{"done": 1}', "completed",
                                            keep_cancelled=True)
            got = await s.get(A, "r")
            assert got is not None and got.status == "cancelled" and got.response == '{"c": 1}'
        finally:
            await s.close()
    run(body())


def test_eviction_at_the_count_bound_oldest_first(make: Callable[..., Any]) -> None:
    async def body() -> None:
        s = make(max_count=5)
        try:
            for i in range(8):
                await s.put_response(A, f"r{i}", "{}", "completed")
                time.sleep(0.002)  # distinct creation times
            assert await s.size() == 5
            assert [await s.get(A, f"r{i}") is None for i in range(8)] == \
                [True, True, True, False, False, False, False, False]
        finally:
            await s.close()
    run(body())


def test_eviction_at_the_age_bound(make: Callable[..., Any]) -> None:
    async def body() -> None:
        s = make(max_age_s=1.0)
        try:
            await s.put_response(A, "old", "{}", "completed")
            time.sleep(1.2)
            assert await s.get(A, "old") is None  # past its age: not served
            await s.put_response(A, "new", "{}", "completed")  # a write evicts it
            assert await s.size() == 1 and await s.get(A, "new") is not None
        finally:
            await s.close()
    run(body())


def test_sqlite_is_shared_by_processes(tmp_path: Path) -> None:
    """Four processes write to one file at once; every record is there (WAL, busy wait)."""
    code = (
        "import asyncio, sys\n"
        "from deployments.responses.sqlite import SQLiteStore\n"
        "from deployments.responses.store import Quota\n"
        "async def main():\n"
        "    s = SQLiteStore(sys.argv[1], Quota(3600, 10000), 5.0)\n"
        "    for i in range(50):\n"
        "        await s.put_response('local', f'{sys.argv[2]}-{i}', '{}', 'completed')\n"
        "    await s.close()\n"
        "asyncio.run(main())\n")
    path = tmp_path / "shared.sqlite3"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), f"p{n}"])
             for n in range(4)]
    assert [p.wait(120) for p in procs] == [0, 0, 0, 0]
    s = SQLiteStore(path, Quota(3600, 10000), 2.0)
    assert run(s.size()) == 200


def test_sqlite_unwritable_is_a_named_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError):  # refused at start, the path named
        SQLiteStore(blocker / "sub" / "r.sqlite3", Quota(3600, 10), 1.0)


def test_redis_killed_mid_run_then_back(redis_server: RedisServer) -> None:
    """A dead server is a StoreError within the deadline (never a hang); when it is
    back, the same client works again."""
    async def body() -> None:
        s = redis_store(redis_server)
        try:
            await s.put_response(A, "before", "{}", "completed")
            redis_server.stop()
            started = time.monotonic()
            with pytest.raises(StoreError, match="Redis Responses store") as err:
                await s.get(A, "before")
            assert time.monotonic() - started < 3.0
            assert "before" not in str(err.value) and PASSWORD not in str(err.value)
            with pytest.raises(StoreError):
                await s.put_response(A, "during", "{}", "completed")
            redis_server.start()
            # no persistence in the test server: what it held is gone, writes work again
            assert await s.put_response(A, "after", "{}", "completed")
            assert await s.get(A, "after") is not None
        finally:
            if redis_server.proc is None:
                redis_server.start()
            await s.close()
    run(body())


def test_redis_refuses_a_wrong_password(redis_server: RedisServer) -> None:
    async def body() -> None:
        s = RedisStore(redis_server.url, "wrong", "p", Quota(3600, 10), 1.0)
        try:
            with pytest.raises(StoreError, match="could not read"):
                await s.get(A, "r")
        finally:
            await s.close()
    run(body())


def test_settings_refuse_what_they_would_ignore() -> None:
    with pytest.raises(ValueError, match=r"needs responses\.url"):
        Settings(backend="redis")
    with pytest.raises(ValueError, match="would ignore"):
        Settings(url="redis://h:1/0")
    with pytest.raises(ValueError, match="carries credentials"):
        Settings(backend="redis", url="redis://:secret@h:1/0")


def test_open_store_picks_the_backend(tmp_path: Path, redis_server: RedisServer,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    s = open_store(Settings(sqlite_path=str(tmp_path / "x.sqlite3")), "app")
    assert isinstance(s, SQLiteStore)
    monkeypatch.setenv("DSV4_RESPONSES_STORE_PASSWORD", PASSWORD)
    r = open_store(Settings(backend="redis", url=redis_server.url), "app")
    assert isinstance(r, RedisStore)
    assert run(r.size()) >= 0
