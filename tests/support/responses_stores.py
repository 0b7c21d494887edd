"""The Responses store's test helpers: both real backends, and vLLM's real
``OpenAIServingResponses`` bound to a store without an engine.

``make`` is a fixture (import it into a test module to use it): one store per backend,
SQLite on a file and Redis on the session's server. ``replica`` is vLLM's own class
built without ``__init__``, holding only the state its Responses paths use, bound to a
store; the generation a background run would do is the one stand-in.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from deployments.responses.binding import StoreBinding
from deployments.responses.redis_store import RedisStore
from deployments.responses.sqlite import SQLiteStore
from deployments.responses.store import Quota, ResponsesStore, owner_of
from deployments.responses.views import OWNER
from tests.support.redis_server import PASSWORD, RedisServer

T = TypeVar("T")
A, B = owner_of("a" * 64), owner_of("b" * 64)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def quota(**kw: Any) -> Quota:
    return Quota(kw.get("max_age_s", 3600.0), kw.get("max_count", 1000),
                 kw.get("max_bytes", 1 << 20), kw.get("max_record_bytes", 1 << 20))


def sqlite_store(tmp_path: Path, **kw: Any) -> SQLiteStore:
    return SQLiteStore(tmp_path / "r.sqlite3", quota(**kw), 2.0)


_prefixes = iter(range(1_000_000))


def redis_store(server: RedisServer, **kw: Any) -> RedisStore:
    return RedisStore(server.url, PASSWORD, f"t{next(_prefixes)}:{time.time_ns()}",
                      quota(**kw), 1.0)


@pytest.fixture(params=["sqlite", "redis"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., Any]:
    if request.param == "sqlite":
        return lambda **kw: sqlite_store(tmp_path, **kw)
    server = request.getfixturevalue("redis_server")
    return lambda **kw: redis_store(server, **kw)


def response(rid: str, status: str) -> Any:
    from vllm.entrypoints.openai.responses.protocol import ResponsesResponse

    return ResponsesResponse.model_validate({
        "id": rid, "created_at": 1, "model": "m", "output": [], "status": status,
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "top_p": 1.0,
        "temperature": 1.0, "background": status in ("queued", "in_progress"),
        "max_output_tokens": 16, "service_tier": "auto", "truncation": "disabled"})


def replica(store: ResponsesStore) -> StoreBinding:
    """vLLM's class with the state its Responses paths read; the generation stood in."""
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    serving = object.__new__(OpenAIServingResponses)
    serving.response_store, serving.msg_store, serving.event_store = {}, {}, {}
    serving.response_store_lock = asyncio.Lock()
    serving.background_tasks = {}
    serving.use_harmony = False

    async def generate(request: Any, *args: Any, **kwargs: Any) -> None:
        await asyncio.Event().wait()  # an engine would generate here until cancelled
    serving._run_background_request = generate
    serving._run_background_request_stream = generate
    binding = StoreBinding(serving, store, cancel_poll_s=0.2)
    binding.install()
    return binding


def as_owner(owner: str, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run ``coro`` as a request of ``owner`` (what ``OwnerScope`` sets)."""
    token = OWNER.set(owner)
    try:
        return asyncio.ensure_future(coro)
    finally:
        OWNER.reset(token)
