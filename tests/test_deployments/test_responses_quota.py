"""Per-key quotas, private files, and writes that are whole or absent (issue 52), on the
real backends: SQLite on a file, Redis on the session's server.

One key's writes never evict another key's records; a key beyond its records or bytes
loses its own oldest; a record above ``max_record_bytes`` is refused naming the limit,
nothing stored; the Redis script touches only the keys it declares (one hash tag: one
Cluster slot) and reads the server's clock; a SQLite write answered "nothing was stored"
stored nothing; the default SQLite directory is this user's, 0700, its file 0600.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deployments.responses import private
from deployments.responses.open import default_sqlite_path
from deployments.responses.sqlite import SQLiteStore
from deployments.responses.store import Quota, QuotaExceeded, StoreError
from tests.support.redis_server import PASSWORD, RedisServer
from tests.support.responses_stores import A, B, make, redis_store, run

__all__ = ["make"]  # the fixture, both backends


def test_one_keys_writes_never_evict_anothers(make: Callable[..., Any]) -> None:
    async def body() -> None:
        s = make(max_count=5)
        try:
            await s.put_response(B, "b0", "{}", "completed")
            for i in range(12):
                await s.put_response(A, f"a{i}", "{}", "completed")
                time.sleep(0.002)
            assert await s.get(B, "b0") is not None, "A's writes evicted B's record"
            kept = [await s.get(A, f"a{i}") is not None for i in range(12)]
            assert kept == [False] * 7 + [True] * 5
        finally:
            await s.close()
    run(body())


def test_a_key_beyond_its_bytes_loses_its_own_oldest(make: Callable[..., Any]) -> None:
    async def body() -> None:
        s = make(max_bytes=4096, max_record_bytes=2048)
        try:
            await s.put_response(B, "b0", "x" * 2000, "completed")
            for i in range(6):
                await s.put_record(A, f"a{i}", "m" * 500, "r" * 500, "completed")
                time.sleep(0.002)
            kept = [await s.get(A, f"a{i}") is not None for i in range(6)]
            assert kept == [False, False, True, True, True, True]  # 4 x 1000 <= 4096
            assert await s.get(B, "b0") is not None
        finally:
            await s.close()
    run(body())


def test_a_record_above_its_limit_is_refused_and_nothing_stored(
        make: Callable[..., Any]) -> None:
    async def body() -> None:
        s = make(max_record_bytes=2048)
        try:
            with pytest.raises(QuotaExceeded, match=r"responses\.max_record_bytes=2048.*Fix"):
                await s.put_record(A, "big", "m" * 1500, "r" * 1500, "completed")
            assert await s.get(A, "big") is None
            await s.put_messages(A, "grow", "m" * 1500)
            with pytest.raises(QuotaExceeded):  # the record as a whole counts
                await s.put_response(A, "grow", "r" * 1500, "completed")
            got = await s.get(A, "grow")
            assert got is not None and got.response is None and got.messages == "m" * 1500
        finally:
            await s.close()
    run(body())


# ------------------------------------------------------------------ Redis: keys and clock

_KEYED = {"HSET", "HGET", "HDEL", "HINCRBY", "HEXISTS", "HMGET", "HGETALL", "ZADD", "ZREM",
          "ZRANGE", "ZRANGEBYSCORE", "ZCARD", "EXPIRE", "PEXPIRE", "DEL", "EXISTS"}


def _watch(server: RedisServer, seen: list[dict[str, Any]], stop: threading.Event) -> None:
    import redis

    client = redis.Redis.from_url(server.url, password=PASSWORD, decode_responses=True)
    with client.monitor() as monitor:
        for command in monitor.listen():
            seen.append(command)
            if stop.is_set():
                return


def test_the_redis_script_touches_only_declared_keys_by_the_servers_clock(
        redis_server: RedisServer) -> None:
    """MONITOR sees every command a script runs: each key is one the call declared, all
    under one hash tag (one Cluster slot), and the script reads TIME."""
    from redis.crc import key_slot

    seen: list[dict[str, Any]] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(redis_server, seen, stop), daemon=True)
    watcher.start()
    time.sleep(0.3)

    async def body() -> None:
        s = redis_store(redis_server, max_count=3, max_age_s=1.0)
        try:
            for i in range(6):
                await s.put_response(A, f"r{i}", "{}", "completed")
            time.sleep(1.1)
            await s.put_response(A, "late", "{}", "completed")  # the others expired
            await s.get(A, "late")
        finally:
            await s.close()
    run(body())
    stop.set()
    import redis
    redis.Redis.from_url(redis_server.url, password=PASSWORD).ping()  # wakes the watcher
    watcher.join(5)
    declared: set[str] = set()
    lua_keys, lua_commands = set(), []
    for command in seen:
        words = command["command"].split()
        if words and words[0].upper() in ("EVALSHA", "EVAL"):
            declared |= set(words[3:3 + int(words[2])])
        elif command.get("client_type") == "lua" and words:
            lua_commands.append(words[0].upper())
            if words[0].upper() in _KEYED:
                lua_keys.add(words[1])
    assert lua_commands, "MONITOR saw no script commands"
    assert lua_keys <= declared, f"undeclared keys touched: {lua_keys - declared}"
    assert len({key_slot(k.encode()) for k in declared}) == 1, declared
    assert "TIME" in lua_commands, "eviction must use the server's clock"
    assert {"HDEL", "ZREM"} & set(lua_commands), "nothing was evicted"


def test_redis_at_its_memory_limit_is_named_and_nothing_half_written(
        redis_server: RedisServer) -> None:
    import redis

    admin = redis.Redis.from_url(redis_server.url, password=PASSWORD)

    async def body() -> None:
        s = redis_store(redis_server)
        try:
            await s.put_messages(A, "r", "m" * 100)
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", 1)  # below what it holds: every write refused
            with pytest.raises(StoreError, match=r"memory limit \(maxmemory\)"):
                await s.put_record(A, "r", "m" * 200, "r" * 200, "completed")
            admin.config_set("maxmemory", 0)
            got = await s.get(A, "r")
            assert got is not None and got.messages == "m" * 100 and got.response is None
        finally:
            admin.config_set("maxmemory", 0)
            await s.close()
    run(body())


# ------------------------------------------------------------------ SQLite: one deadline


def test_a_sqlite_write_answered_unavailable_stored_nothing(tmp_path: Path) -> None:
    """A write queued behind another call of the replica (the store's one thread busy
    0.6 s) while another process holds the write lock until 1.3 s, deadline 1.0 s: it is
    answered StoreError at 1.0 s, and it must not commit afterwards (its busy wait once
    counted from the thread's start, not from the attempt's)."""
    path = tmp_path / "r.sqlite3"
    run(_write(path))
    held = threading.Event()

    def hold() -> None:
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        held.set()
        time.sleep(1.3)
        other.execute("ROLLBACK")
        other.close()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(5)

    async def body() -> BaseException | bool:
        s = SQLiteStore(path, Quota(3600, 100), 1.0)
        try:
            s._pool.submit(time.sleep, 0.6)  # another call of this replica, still running
            try:
                result: BaseException | bool = await s.put_response(A, "late", "{}",
                                                                    "completed")
            except StoreError as exc:
                result = exc
            await asyncio.sleep(1.5)  # whatever still ran in the thread is done
            if isinstance(result, StoreError):
                assert await s.get(A, "late") is None, (
                    f"answered {result}, yet committed")
            return result
        finally:
            await s.close()
    result = asyncio.run(body())
    holder.join()
    assert isinstance(result, StoreError)


# ------------------------------------------------------------------ the private directory


def test_the_default_store_is_this_users_and_private(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    path = default_sqlite_path("app")
    assert not str(path).startswith("/tmp/dsv4-serve/")
    SQLiteStore(path, Quota(), 1.0)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    run(_write(path))
    for extra in path.parent.iterdir():  # -wal, -shm: the database file's mode
        assert stat.S_IMODE(extra.stat().st_mode) & 0o077 == 0, extra


async def _write(path: Path) -> None:
    s = SQLiteStore(path, Quota(), 1.0)
    await s.put_response(A, "r", "{}", "completed")
    await s.close()


@pytest.mark.parametrize("case", ["group_readable_dir", "world_readable_file",
                                  "symlinked_dir", "symlinked_file", "others_dir"])
def test_a_store_path_not_private_is_refused_naming_it(tmp_path: Path, case: str) -> None:
    directory = tmp_path / "store"
    directory.mkdir(mode=0o700)
    file = directory / "r.sqlite3"
    if case == "group_readable_dir":
        directory.chmod(0o750)
    elif case == "world_readable_file":
        file.touch(mode=0o644)
        file.chmod(0o644)
    elif case == "symlinked_dir":
        real = tmp_path / "real"
        real.mkdir(mode=0o700)
        directory.rmdir()
        directory.symlink_to(real)
    elif case == "symlinked_file":
        (tmp_path / "elsewhere").touch(mode=0o600)
        file.symlink_to(tmp_path / "elsewhere")
    elif case == "others_dir":
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(directory, 65534, 65534)
    with pytest.raises((private.PrivatePathError, OSError)) as err:
        SQLiteStore(file, Quota(), 1.0)
    assert str(directory) in str(err.value) or str(file) in str(err.value)
    if isinstance(err.value, private.PrivatePathError):
        assert "Fix" in str(err.value)
