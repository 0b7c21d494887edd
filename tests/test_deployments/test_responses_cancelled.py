"""A cancelled stored create leaves nothing behind on the replica (issue 52).

vLLM's ``create_responses`` puts the request's input messages in ``msg_store[id]``
before it generates; a create that never completes (the client went away, the edge's
``http.stream_max_s``, a stream dropped before its first event) must free that copy.
vLLM's real ``OpenAIServingResponses`` instance is bound to a real SQLite store; its
create is stood in by what vLLM's does for a stored request before the engine answers
(the msg_store write, then a wait an engine would fill). 2,000 cancelled 1 MB creates:
the views end empty and the process's RSS is back within 10 % of before.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil

from deployments.responses.binding import StoreBinding
from deployments.responses.sqlite import SQLiteStore
from deployments.responses.store import Quota
from deployments.responses.views import OWNER
from tests.support.responses_stores import replica as _replica

MB = 1 << 20
CREATES = 2000


def _bind(tmp_path: Path) -> StoreBinding:
    store = SQLiteStore(tmp_path / "s.sqlite3", Quota(3600.0, 100), 2.0)
    binding = _replica(store)

    async def create(request: Any, raw_request: Any = None) -> Any:
        """vLLM's create for a stored request: the input first, then the engine."""
        binding.serving.msg_store[request.request_id] = [
            {"role": "user", "content": "x" * MB}]
        if request.stream:
            async def events() -> AsyncIterator[Any]:
                await asyncio.Event().wait()  # the engine's first token never comes
                yield None
            return events()
        await asyncio.Event().wait()  # the engine generates until cancelled
    binding._create = create
    return binding


async def _cancelled(binding: StoreBinding, n: int, how: str) -> None:
    request = SimpleNamespace(request_id=f"resp_{how}_{n}", previous_response_id=None,
                              background=False, stream=how != "client_gone")
    task = asyncio.ensure_future(binding.create(request))
    if how == "client_gone":  # cancelled while vLLM generates
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return
    stream = await task
    if how == "stream_max_s":  # started, then closed by the edge's deadline
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()
    del stream  # "before_start": dropped before its first event


def test_cancelled_stored_creates_free_vllms_copies(tmp_path: Path) -> None:
    binding = _bind(tmp_path)
    process = psutil.Process()

    async def run() -> tuple[int, int]:
        token = OWNER.set("local")
        try:
            for n in range(20):  # warm the allocator
                await _cancelled(binding, n, "client_gone")
            gc.collect()
            before = process.memory_info().rss
            for n in range(CREATES):
                await _cancelled(binding, n, ("client_gone", "stream_max_s",
                                              "before_start")[n % 3])
            gc.collect()
            return before, process.memory_info().rss
        finally:
            OWNER.reset(token)

    before, after = asyncio.run(run())
    assert len(binding.messages) == 0 and not binding.messages.dirty, len(binding.messages)
    assert len(binding.responses) == 0
    assert after <= before * 1.10, (
        f"RSS {before / MB:.0f} MB before {CREATES} cancelled 1 MB creates, "
        f"{after / MB:.0f} MB after")
