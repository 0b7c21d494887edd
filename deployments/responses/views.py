"""What vLLM sees as its Responses dicts: this replica's working copies, per owner.

vLLM reads and writes ``response_store``/``msg_store``/``event_store`` with plain,
synchronous dict calls (``get``, ``[]``, ``in``, ``[]=``). An ``OwnedView`` answers
them from local copies keyed by ``(owner, id)``, the owner being the request's
(``OWNER``, set by ``OwnerScope`` from the edge's key digest): a copy loaded for one
key is invisible to another. The store is never reached from these calls (they
cannot await); ``deployments.responses.binding`` loads what a request needs before
vLLM runs and saves what vLLM wrote (``dirty``) after, with the store's deadline.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Generic, TypeVar

from deployments.http.refusal import mark_public_error
from deployments.responses.store import LOCAL_OWNER, owner_of

V = TypeVar("V")
Key = tuple[str, str]

# The owner of the request being served (copied into the tasks it starts).
OWNER: ContextVar[str] = ContextVar("dsv4_responses_owner", default=LOCAL_OWNER)
# The request's ASGI scope (set by ``OwnerScope``): a store failure marks its 503 public,
# so the edge's scrub lets "the ... Responses store is unavailable" reach the client.
REQUEST_SCOPE: ContextVar[dict[str, Any] | None] = ContextVar("dsv4_responses_scope",
                                                               default=None)


def mark_store_error_public() -> None:
    """The store's 503 names only the store and the fix: let it out as written."""
    scope = REQUEST_SCOPE.get()
    if scope is not None:
        mark_public_error(scope)
# Where the edge's auth middleware leaves the SHA-256 hex of the request's API key.
DIGEST_STATE_KEY = "dsv4_key_digest"


class OwnedView(Generic[V]):
    """A bounded dict of local copies keyed by ``(OWNER, id)``; remembers what vLLM wrote.

    ``limit`` bounds the clean copies (oldest dropped first); a copy vLLM wrote and
    nobody saved yet (``dirty``), or one ``pinned`` says a running task holds, is kept.
    ``saved=False``: a view whose copies never go to the store (bounded by ``limit`` only).
    """

    def __init__(self, limit: int, pinned: Callable[[str], bool] = lambda _: False,
                 saved: bool = True) -> None:
        self._local: OrderedDict[Key, V] = OrderedDict()
        self.dirty: set[Key] = set()
        self._limit, self._pinned, self._saved = limit, pinned, saved

    @staticmethod
    def key(response_id: str) -> Key:
        return (OWNER.get(), response_id)

    def get(self, response_id: str, default: V | None = None) -> V | None:
        return self._local.get(self.key(response_id), default)

    def __getitem__(self, response_id: str) -> V:
        return self._local[self.key(response_id)]

    def __contains__(self, response_id: object) -> bool:
        return isinstance(response_id, str) and self.key(response_id) in self._local

    def __setitem__(self, response_id: str, value: V) -> None:
        key = self.key(response_id)
        self._local[key] = value
        self._local.move_to_end(key)
        if self._saved:  # a view nobody saves (the event streams) keeps no dirty marks
            self.dirty.add(key)
        self._trim()

    def pop(self, response_id: str, default: V | None = None) -> V | None:
        key = self.key(response_id)
        self.dirty.discard(key)
        return self._local.pop(key, default)

    def __len__(self) -> int:
        return len(self._local)

    def load(self, key: Key, value: V | None) -> None:
        """Replace the local copy with the store's (None: there is none)."""
        self.dirty.discard(key)
        if value is None:
            self._local.pop(key, None)
        else:
            self._local[key] = value
            self._local.move_to_end(key)
            self._trim()

    def take(self, key: Key, force: bool = False) -> V | None:
        """The copy to save: one vLLM wrote (or any, with ``force``); marks it saved."""
        if key not in self.dirty and not force:
            return None
        self.dirty.discard(key)
        return self._local.get(key)

    def drop(self, key: Key) -> None:
        """Forget a saved copy no running task holds."""
        if key not in self.dirty and not self._pinned(key[1]):
            self._local.pop(key, None)

    def discard(self, key: Key) -> None:
        """Forget a copy that will never be saved (a failed or abandoned request)."""
        if not self._pinned(key[1]):
            self.dirty.discard(key)
            self._local.pop(key, None)

    def _trim(self) -> None:
        extra = len(self._local) - self._limit
        for key in list(self._local)[:max(0, extra)]:
            if key not in self.dirty and not self._pinned(key[1]):
                del self._local[key]


class OwnerScope:
    """ASGI middleware: the request's store owner, from the edge's key digest.

    Sits inside the edge (after its auth middleware has put ``dsv4_key_digest`` in
    the scope's state); the owner follows the request into every task it starts.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        state = scope.get("state") or {}
        token = OWNER.set(owner_of(state.get(DIGEST_STATE_KEY)))
        scoped = REQUEST_SCOPE.set(scope)
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_SCOPE.reset(scoped)
            OWNER.reset(token)
