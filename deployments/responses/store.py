"""What every Responses store backend offers, the owner a record is filed under, its quota.

A record is one stored response: its JSON (vLLM's ``ResponsesResponse``), the input
messages vLLM continues a conversation from (its ``msg_store`` entry), and its status,
kept apart so a cancel made on one replica is never overwritten by the replica still
running it (``put_response(..., keep_cancelled=True)``). Records are filed under
``(owner, id)``: a lookup under another owner finds nothing, exactly like a missing id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

# The owner of everything stored without API keys (a loopback app): one owner.
LOCAL_OWNER = "local"


def owner_of(key_digest: str | None) -> str:
    """The store owner for an API key's SHA-256 hex digest (None: keyless, one owner)."""
    if key_digest is None:
        return LOCAL_OWNER
    if len(key_digest) != 64 or any(c not in "0123456789abcdef" for c in key_digest):
        raise ValueError(f"key digest of {len(key_digest)} characters: expected the SHA-256 "
                         "hex digest of the API key (64 lowercase hex)")
    return "k" + key_digest


class StoreError(RuntimeError):
    """The store did not answer in time or refused; the message names the backend, never
    an id, a key or a record."""


class QuotaExceeded(StoreError):
    """One record is larger than ``responses.max_record_bytes``: refused (a 4xx), nothing
    written; the message names the limit and the fix."""


@dataclass(frozen=True)
class Quota:
    """What one key (owner) may keep. Beyond ``max_records_per_key`` or
    ``max_bytes_per_key`` the key's own oldest records go (never another key's); a
    record above ``max_record_bytes`` is refused. Records older than ``max_age_s`` go,
    by the store's clock."""

    max_age_s: float = 30 * 24 * 3600.0
    max_records_per_key: int = 10_000
    max_bytes_per_key: int = 128 << 20
    max_record_bytes: int = 8 << 20

    def too_large(self, size: int) -> QuotaExceeded:
        return QuotaExceeded(
            f"this response and its input messages are {size} bytes, above the store's "
            f"limit responses.max_record_bytes={self.max_record_bytes}; nothing was stored. "
            "Fix: send store: false (and the whole conversation as input), shorten the "
            "conversation, or ask the operator to raise responses.max_record_bytes.")


@dataclass(frozen=True)
class Record:
    """One stored response as the store holds it (plain JSON text)."""

    response: str | None
    messages: str | None
    status: str | None
    created: float


class ResponsesStore(Protocol):
    """An async store shared by every replica; every call has the store's deadline."""

    kind: str

    async def get(self, owner: str, response_id: str) -> Record | None:
        """The record, or None (missing, evicted, or another owner's)."""
        ...

    async def put_response(self, owner: str, response_id: str, response: str,
                           status: str, keep_cancelled: bool = False) -> bool:
        """Store the response; with ``keep_cancelled`` a stored cancel wins (False)."""
        ...

    async def put_messages(self, owner: str, response_id: str, messages: str) -> None:
        """Store the input messages a follow-up continues from."""
        ...

    async def put_record(self, owner: str, response_id: str, messages: str | None,
                         response: str | None, status: str | None,
                         keep_cancelled: bool = False) -> bool:
        """One atomic write of what is given (None: keep what is stored): all of it, or
        nothing (``QuotaExceeded``, ``StoreError``); with ``keep_cancelled`` a stored
        cancel wins (False)."""
        ...

    async def statuses(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
        """The status of each ``(owner, id)`` that is stored."""
        ...

    async def size(self) -> int:
        """Records held now."""
        ...

    async def close(self) -> None:
        ...


class RecordWrites:
    """``put_response`` and ``put_messages`` as the one ``put_record`` write each store has."""

    async def put_record(self, owner: str, response_id: str, messages: str | None,
                         response: str | None, status: str | None,
                         keep_cancelled: bool = False) -> bool:
        raise NotImplementedError  # each store's own atomic write

    async def put_response(self, owner: str, response_id: str, response: str,
                           status: str, keep_cancelled: bool = False) -> bool:
        return await self.put_record(owner, response_id, None, response, status,
                                     keep_cancelled)

    async def put_messages(self, owner: str, response_id: str, messages: str) -> None:
        await self.put_record(owner, response_id, messages, None, None)


def now() -> float:
    return time.time()
