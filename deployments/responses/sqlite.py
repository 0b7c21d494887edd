"""The embedded backend: one SQLite file that every replica on the machine opens.

WAL journal (readers never wait for the writer; several processes may open it), and
every statement in one worker thread of this replica: the replica's event loop never
blocks on the file. An attempt has one deadline, ``timeout_s`` from when it was asked
for: the busy wait gets what is left of it, and a write whose deadline passed before its
``COMMIT`` rolls back, so a write answered "nothing was stored" stored nothing. The
quota (``store.Quota``) is applied in the same transaction as each write: rows past
``max_age_s`` go, then the writing key's own oldest beyond its records or bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from deployments.responses.private import prepare
from deployments.responses.store import Quota, Record, RecordWrites, StoreError, now

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    owner TEXT NOT NULL, id TEXT NOT NULL, created REAL NOT NULL,
    status TEXT, response TEXT, messages TEXT, bytes INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (owner, id));
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
CREATE INDEX IF NOT EXISTS responses_owner_created ON responses (owner, created);
"""
# The writing key's rows beyond its quota, oldest first; the row being written ranks
# first so it is never its own victim (it alone fits: max_record_bytes is checked).
_OVER_QUOTA = """
DELETE FROM responses WHERE rowid IN (SELECT rowid FROM (SELECT rowid,
    ROW_NUMBER() OVER w AS n, SUM(bytes) OVER w AS total FROM responses WHERE owner=?
    WINDOW w AS (ORDER BY id=? DESC, created DESC, rowid DESC))
  WHERE n > ? OR total > ?)
"""
_GRACE_S = 1.0  # past the deadline, for a COMMIT already under way


class _Late(Exception):
    """The attempt's deadline passed before its COMMIT: rolled back."""


class SQLiteStore(RecordWrites):
    """``store.ResponsesStore`` on a SQLite file."""

    kind = "sqlite"

    def __init__(self, path: str | Path, quota: Quota, timeout_s: float) -> None:
        self.path = Path(path)
        self.quota, self.timeout_s = quota, timeout_s
        prepare(self.path)  # ours alone, or refused now with the path named
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "dsv4-responses-sqlite")
        self._db: sqlite3.Connection | None = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            db = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None,
                                 check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            columns = {r[1] for r in db.execute("PRAGMA table_info(responses)")}
            if columns and "bytes" not in columns:  # a file an older release made
                db.execute("ALTER TABLE responses ADD COLUMN bytes INTEGER NOT NULL "
                           "DEFAULT 0")
            db.executescript(_SCHEMA)
            self._db = db
        return self._db

    async def _run(self, what: str, job: Callable[[sqlite3.Connection, float], T]) -> T:
        deadline = time.monotonic() + self.timeout_s

        def attempt() -> T:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Late
            db = self._conn()
            db.execute(f"PRAGMA busy_timeout={int(left * 1000)}")
            return job(db, deadline)

        future = asyncio.get_running_loop().run_in_executor(self._pool, attempt)
        try:
            return await asyncio.wait_for(future, self.timeout_s + _GRACE_S)
        except (TimeoutError, asyncio.TimeoutError, _Late) as exc:
            raise StoreError(f"the SQLite Responses store did not {what} within "
                             f"{self.timeout_s}s (responses.timeout_s)") from exc
        except sqlite3.Error as exc:
            raise StoreError(f"the SQLite Responses store could not {what}: "
                             f"{type(exc).__name__}: {exc}") from exc

    async def get(self, owner: str, response_id: str) -> Record | None:
        def job(db: sqlite3.Connection, _: float) -> Record | None:
            row = db.execute("SELECT response, messages, status, created FROM responses "
                             "WHERE owner=? AND id=? AND created>=?",
                             (owner, response_id, now() - self.quota.max_age_s)).fetchone()
            return None if row is None else Record(*row)
        return await self._run("read", job)

    async def put_record(self, owner: str, response_id: str, messages: str | None,
                         response: str | None, status: str | None,
                         keep_cancelled: bool = False) -> bool:
        def job(db: sqlite3.Connection, deadline: float) -> bool:
            with _transaction(db, deadline):
                row = db.execute("SELECT status, response, messages FROM responses "
                                 "WHERE owner=? AND id=?", (owner, response_id)).fetchone()
                if keep_cancelled and row is not None and row[0] == "cancelled":
                    return False
                new_response = response if response is not None else (row and row[1])
                new_messages = messages if messages is not None else (row and row[2])
                size = _size(new_response) + _size(new_messages)
                if size > self.quota.max_record_bytes:
                    raise self.quota.too_large(size)
                db.execute(
                    "INSERT INTO responses (owner, id, created, status, response, messages, "
                    "bytes) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (owner, id) DO UPDATE "
                    "SET status=coalesce(excluded.status, status), response=excluded.response,"
                    " messages=excluded.messages, bytes=excluded.bytes",
                    (owner, response_id, now(), status, new_response, new_messages, size))
                self._evict(db, owner, response_id)
            return True
        return await self._run("write", job)

    async def statuses(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
        def job(db: sqlite3.Connection, _: float) -> dict[tuple[str, str], str]:
            found = {}
            for owner, response_id in keys:
                row = db.execute("SELECT status FROM responses WHERE owner=? AND id=?",
                                 (owner, response_id)).fetchone()
                if row is not None and row[0] is not None:
                    found[(owner, response_id)] = row[0]
            return found
        return await self._run("read", job)

    async def size(self) -> int:
        return await self._run("count", lambda db, _: int(
            db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]))

    def _evict(self, db: sqlite3.Connection, owner: str, response_id: str) -> None:
        """Past the age (anyone's: expired), then the writing key's own oldest beyond its
        records or bytes (inside the write)."""
        db.execute("DELETE FROM responses WHERE created<?", (now() - self.quota.max_age_s,))
        db.execute(_OVER_QUOTA, (owner, response_id, self.quota.max_records_per_key,
                                 self.quota.max_bytes_per_key))

    async def close(self) -> None:
        def job() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None
        await asyncio.get_running_loop().run_in_executor(self._pool, job)
        self._pool.shutdown(wait=False)


def _size(text: str | None) -> int:
    return 0 if text is None else len(text.encode())


class _transaction:
    """``BEGIN IMMEDIATE`` .. ``COMMIT`` (rollback on error, or when the attempt's
    deadline passed before the COMMIT): one writer at a time across processes."""

    def __init__(self, db: sqlite3.Connection, deadline: float) -> None:
        self.db, self.deadline = db, deadline

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None and time.monotonic() > self.deadline:
            self.db.execute("ROLLBACK")
            raise _Late
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")
