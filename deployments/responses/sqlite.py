"""The embedded backend: one SQLite file that every replica on the machine opens.

WAL journal (readers never wait for the writer; several processes may open it), a
busy timeout equal to the store's deadline, and every statement in one worker thread
of this replica, awaited with that deadline: the replica's event loop never blocks on
the file. Bounds are applied on every write, in the same transaction: rows older
than ``max_age_s`` go, then the oldest beyond ``max_count``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from deployments.responses.store import Record, StoreError, now

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    owner TEXT NOT NULL, id TEXT NOT NULL, created REAL NOT NULL,
    status TEXT, response TEXT, messages TEXT, PRIMARY KEY (owner, id));
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
"""


class SQLiteStore:
    """``store.ResponsesStore`` on a SQLite file."""

    kind = "sqlite"

    def __init__(self, path: str | Path, max_age_s: float, max_count: int,
                 timeout_s: float) -> None:
        self.path = Path(path)
        self.max_age_s, self.max_count, self.timeout_s = max_age_s, max_count, timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "dsv4-responses-sqlite")
        self._db: sqlite3.Connection | None = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None,
                                 check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            self._db = db
        return self._db

    async def _run(self, what: str, job: Callable[[sqlite3.Connection], T]) -> T:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, lambda: job(self._conn()))
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise StoreError(f"the SQLite Responses store did not {what} within "
                             f"{self.timeout_s}s (responses.timeout_s)") from exc
        except sqlite3.Error as exc:
            raise StoreError(f"the SQLite Responses store could not {what}: "
                             f"{type(exc).__name__}: {exc}") from exc

    async def get(self, owner: str, response_id: str) -> Record | None:
        def job(db: sqlite3.Connection) -> Record | None:
            row = db.execute("SELECT response, messages, status, created FROM responses "
                             "WHERE owner=? AND id=? AND created>=?",
                             (owner, response_id, now() - self.max_age_s)).fetchone()
            return None if row is None else Record(*row)
        return await self._run("read", job)

    async def put_response(self, owner: str, response_id: str, response: str,
                           status: str, keep_cancelled: bool = False) -> bool:
        def job(db: sqlite3.Connection) -> bool:
            with _transaction(db):
                row = db.execute("SELECT status FROM responses WHERE owner=? AND id=?",
                                 (owner, response_id)).fetchone()
                if keep_cancelled and row is not None and row[0] == "cancelled":
                    return False
                if row is None:
                    db.execute("INSERT INTO responses (owner, id, created, status, response) "
                               "VALUES (?, ?, ?, ?, ?)",
                               (owner, response_id, now(), status, response))
                else:
                    db.execute("UPDATE responses SET status=?, response=? WHERE owner=? "
                               "AND id=?", (status, response, owner, response_id))
                self._evict(db)
            return True
        return await self._run("write", job)

    async def put_messages(self, owner: str, response_id: str, messages: str) -> None:
        def job(db: sqlite3.Connection) -> None:
            with _transaction(db):
                db.execute("INSERT INTO responses (owner, id, created, messages) VALUES "
                           "(?, ?, ?, ?) ON CONFLICT (owner, id) DO UPDATE SET "
                           "messages=excluded.messages", (owner, response_id, now(), messages))
                self._evict(db)
        await self._run("write", job)

    async def statuses(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
        def job(db: sqlite3.Connection) -> dict[tuple[str, str], str]:
            found = {}
            for owner, response_id in keys:
                row = db.execute("SELECT status FROM responses WHERE owner=? AND id=?",
                                 (owner, response_id)).fetchone()
                if row is not None and row[0] is not None:
                    found[(owner, response_id)] = row[0]
            return found
        return await self._run("read", job)

    async def size(self) -> int:
        return await self._run("count", lambda db: int(
            db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]))

    def _evict(self, db: sqlite3.Connection) -> None:
        """Oldest first: past the age, then beyond the count (inside the write)."""
        db.execute("DELETE FROM responses WHERE created<?", (now() - self.max_age_s,))
        db.execute("DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses "
                   "ORDER BY created ASC, rowid ASC LIMIT max(0, (SELECT COUNT(*) FROM "
                   "responses) - ?))", (self.max_count,))

    async def close(self) -> None:
        def job() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None
        await asyncio.get_running_loop().run_in_executor(self._pool, job)
        self._pool.shutdown(wait=False)


class _transaction:
    """``BEGIN IMMEDIATE`` .. ``COMMIT`` (rollback on error): one writer at a time
    across processes, waiting at most the busy timeout."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")
