"""The replica's store ends with the replica, and its poller never dies silently (issue 52).

``dsv4_close_listener`` is what the ingress's ``__del__`` runs on shutdown: after the
port closes, the store's poller is cancelled and its connections closed. The poller
keeps polling after an error that is not a ``StoreError`` (logged, counted).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from deployments.config import HTTPEdge
from deployments.doors.lifecycle import Doors
from deployments.responses.binding import StoreBinding
from deployments.responses.replica import ReplicaStore
from deployments.responses.sqlite import SQLiteStore
from deployments.responses.store import Quota
from deployments.serving.server import DSv4ServerMixin
from tests.support.responses_stores import replica as _replica


def test_shutdown_closes_the_replica_store(tmp_path: Path) -> None:
    async def body() -> None:
        store = SQLiteStore(tmp_path / "r.sqlite3", Quota(), 2.0)
        binding = _replica(store)
        await store.put_response("local", "r", "{}", "completed")
        poller = asyncio.ensure_future(binding.run_poller(lambda _: None))
        server: Any = object.__new__(DSv4ServerMixin)
        server._doors = Doors(HTTPEdge(), False, 1.0)  # no port of its own to close
        server._store = ReplicaStore(binding, poller)
        await server.dsv4_close_listener()
        assert poller.done(), "the poller outlived the replica"
        assert store._db is None and store._pool._shutdown, "the store was left open"
        assert server._store is None
    asyncio.run(body())


class _Flaky(SQLiteStore):
    """The real SQLite store whose status read fails once with a bug (a TypeError)."""

    failed = 0

    async def statuses(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
        if not self.failed:
            self.failed += 1
            raise TypeError("a bug in a status read")
        return await super().statuses(keys)


def test_the_poller_survives_an_unexpected_error(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> tuple[StoreBinding, list[str], asyncio.Task[None]]:
        store = _Flaky(tmp_path / "r.sqlite3", Quota(), 2.0)
        binding = _replica(store)
        errors: list[str] = []
        binding.on_error = errors.append
        binding._running["resp_x"] = "local"  # a background run to poll for
        poller = asyncio.ensure_future(binding.run_poller(lambda _: None))
        await asyncio.sleep(0.7)  # cancel_poll_s is 0.2: a few rounds
        return binding, errors, poller

    async def run() -> None:
        binding, errors, poller = await body()
        try:
            assert not poller.done(), "the poller died on a non-StoreError"
            assert errors == ["poll"]
            assert isinstance(binding.store, _Flaky) and binding.store.failed == 1
        finally:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
            await binding.store.close()
    with caplog.at_level(logging.ERROR):
        asyncio.run(run())
    assert any("poll failed unexpectedly" in r.getMessage() for r in caplog.records)
