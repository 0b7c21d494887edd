"""The views vLLM's Responses code sees (``deployments.responses.views``) and their owner.

Pure code: owner scoping through the context variable (a copy loaded for one key is
invisible to another), what a write marks for saving, the local bound, pinning by a
running background task, and the ASGI middleware that sets the owner from the edge.
"""

from __future__ import annotations

import asyncio
from typing import Any

from deployments.responses.store import LOCAL_OWNER, owner_of
from deployments.responses.views import DIGEST_STATE_KEY, OWNER, OwnedView, OwnerScope

A, B = owner_of("a" * 64), owner_of("b" * 64)


def test_a_copy_is_seen_only_by_its_owner() -> None:
    view: OwnedView[str] = OwnedView(8)
    token = OWNER.set(A)
    try:
        view["resp_1"] = "mine"
        assert view.get("resp_1") == "mine" and "resp_1" in view and view["resp_1"] == "mine"
        assert view.dirty == {(A, "resp_1")}
    finally:
        OWNER.reset(token)
    token = OWNER.set(B)
    try:
        assert view.get("resp_1") is None and "resp_1" not in view
    finally:
        OWNER.reset(token)
    assert OWNER.get() == LOCAL_OWNER and view.get("resp_1") is None


def test_take_marks_saved_and_load_replaces() -> None:
    view: OwnedView[str] = OwnedView(8)
    token = OWNER.set(A)
    try:
        view["r"] = "v1"
        assert view.take((A, "r")) == "v1" and view.take((A, "r")) is None
        assert view.take((A, "r"), force=True) == "v1"
        view.load((A, "r"), "stored")
        assert view.get("r") == "stored" and not view.dirty
        view.load((A, "r"), None)  # the store has none (evicted, or never): none here
        assert view.get("r") is None
    finally:
        OWNER.reset(token)


def test_the_bound_keeps_unsaved_and_pinned_copies() -> None:
    running = {"pinned"}
    view: OwnedView[int] = OwnedView(2, running.__contains__)
    view.load((A, "pinned"), 0)
    token = OWNER.set(A)
    try:
        view["unsaved"] = 1
    finally:
        OWNER.reset(token)
    for i in range(5):
        view.load((A, f"clean{i}"), i)
    assert len(view) <= 4
    kept = {k for k in [(A, "pinned"), (A, "unsaved")] if k[1] in running or k in view.dirty}
    assert kept == {(A, "pinned"), (A, "unsaved")}
    view.drop((A, "pinned"))  # a running task holds it
    token = OWNER.set(A)
    try:
        assert view.get("pinned") == 0 and view.get("unsaved") == 1
        assert view.get("clean0") is None and view.get("clean4") == 4
    finally:
        OWNER.reset(token)


def test_owner_scope_reads_the_edges_digest_and_tasks_inherit_it() -> None:
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(OWNER.get())

        async def background() -> None:
            await asyncio.sleep(0)
            seen.append(OWNER.get())
        await asyncio.create_task(background())

    async def main() -> None:
        scoped = OwnerScope(app)
        await scoped({"type": "http", "state": {DIGEST_STATE_KEY: "b" * 64}}, None, None)
        await scoped({"type": "http", "state": {DIGEST_STATE_KEY: None}}, None, None)
        await scoped({"type": "http"}, None, None)
        assert OWNER.get() == LOCAL_OWNER  # reset after each request
    asyncio.run(main())
    assert seen == [B, B, LOCAL_OWNER, LOCAL_OWNER, LOCAL_OWNER, LOCAL_OWNER]


def test_unsaved_views_stay_bounded_and_abandoned_copies_go() -> None:
    events: OwnedView[int] = OwnedView(3, saved=False)  # event streams: never stored
    token = OWNER.set(A)
    try:
        for i in range(10):
            events[f"r{i}"] = i
        assert len(events) == 3 and not events.dirty
        saved: OwnedView[int] = OwnedView(3)
        saved["gone"] = 1  # a stream the client left before response.completed
        saved.discard((A, "gone"))
        assert saved.get("gone") is None and not saved.dirty
    finally:
        OWNER.reset(token)
