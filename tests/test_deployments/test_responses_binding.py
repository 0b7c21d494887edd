"""The binding on vLLM's real ``OpenAIServingResponses`` code, two "replicas", one store.

No engine: each replica is an instance of vLLM's own class (built without ``__init__``,
holding only the state its Responses paths use), bound to one shared store; vLLM's
real ``retrieve_responses``/``cancel_responses`` run against it. The generation a
background run would do is the one stand-in (an engine would run it). What this shows:
state made on one replica is served by another, a cancel on one stops the task on the
other within the poll, another key gets vLLM's own 404, a dead store is a 503.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments.responses.binding import StoreBinding
from deployments.responses.redis_store import RedisStore
from deployments.responses.sqlite import SQLiteStore
from deployments.responses.store import Quota
from deployments.responses.views import OWNER
from tests.support.redis_server import PASSWORD, RedisServer
from tests.support.responses_stores import A, B
from tests.support.responses_stores import as_owner as _as
from tests.support.responses_stores import replica as _replica
from tests.support.responses_stores import response as _response


async def _start_background(one: StoreBinding, rid: str) -> asyncio.Task[None]:
    """What vLLM's create does for ``background: true`` on replica ``one``."""
    async def create() -> asyncio.Task[None]:
        one.serving.response_store[rid] = _response(rid, "queued")
        one.serving.msg_store[rid] = [{"role": "user", "content": "hi"}]
        task = asyncio.ensure_future(one.serving._run_background_request(
            SimpleNamespace(request_id=rid)))
        one.serving.background_tasks[rid] = task
        await one._save((OWNER.get(), rid))
        return task
    return await _as(A, create())


def test_state_made_on_one_replica_is_served_and_cancelled_on_another(tmp_path: Path) -> None:
    async def body() -> None:
        store = SQLiteStore(tmp_path / "r.sqlite3", Quota(3600, 100), 2.0)
        one, two = _replica(store), _replica(store)
        task = await _start_background(one, "resp_bg")
        got = await _as(A, two.serving.retrieve_responses("resp_bg", None, False))
        assert got.status == "queued"
        # another key: vLLM's own 404, the same as a missing id
        other = await _as(B, two.serving.retrieve_responses("resp_bg", None, False))
        missing = await _as(B, two.serving.retrieve_responses("resp_none", None, False))
        assert other.error.code == missing.error.code == 404
        assert (await _as(B, two.serving.cancel_responses("resp_bg"))).error.code == 404
        # cancel on the other replica: stored; the running one cancels within the poll
        cancelled = await _as(A, two.serving.cancel_responses("resp_bg"))
        assert cancelled.status == "cancelled" and not task.done()
        assert await one.poll_cancels() == 1
        await asyncio.sleep(0.05)
        assert task.cancelled()
        # the run's last save never overwrites the stored cancel
        for replica in (one, two):
            again = await _as(A, replica.serving.retrieve_responses("resp_bg", None, False))
            assert again.status == "cancelled"
        # the event stream stays with the replica running it: a 400 that says so
        streamed = await _as(A, two.serving.retrieve_responses("resp_bg", None, True))
        assert streamed.error.code == 400 and "replica running it" in streamed.error.message
        record = await store.get(A, "resp_bg")
        assert record is not None and record.messages is not None
        assert len(one.responses) == len(two.responses) == 0  # nothing kept locally
        await store.close()
    asyncio.run(body())


def test_a_dead_store_is_a_503_and_then_recovers(redis_server: RedisServer) -> None:
    async def body() -> None:
        store = RedisStore(redis_server.url, PASSWORD, "binding", Quota(3600, 100), 0.5)
        one, two = _replica(store), _replica(store)
        task = await _start_background(one, "resp_x")
        redis_server.stop()
        try:
            down = await _as(A, two.serving.retrieve_responses("resp_x", None, False))
            assert down.error.code == 503 and "Responses store is unavailable" in \
                down.error.message and PASSWORD not in down.error.message
            with pytest.raises(Exception, match="Redis Responses store"):
                await _start_background(one, "resp_y")  # a write fails loudly
        finally:
            redis_server.start()
        await _start_background(one, "resp_z")  # back: writes and reads work again
        got = await _as(A, two.serving.retrieve_responses("resp_z", None, False))
        assert got.status == "queued"
        for t in [task, *one.serving.background_tasks.values()]:
            t.cancel()
        await store.close()
    asyncio.run(body())
