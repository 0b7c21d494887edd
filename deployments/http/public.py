"""What ``GET /v1/kv-spec`` gives clients: coalesced, rate-limited refreshes of a redacted report.

A refresh makes the KV-spec controller broadcast to every replica twice (2N
RPCs), so clients must not be able to trigger them at will: concurrent
``?refresh=true`` requests share one check, and a refresh asked within
``http.kv_spec_refresh_interval_s`` of the last one gets that one's report.

The controller's report is for operators (logs, ``serve status``); the HTTP
answer is public to every key holder, so it is redacted at the edge by *kind*
of content rather than by field list (the report's shape is the controller's to
change): keys that name process ids, paths or tracebacks are dropped, and in
every string absolute paths, ``pid=N`` and traceback text are masked.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

DROPPED_KEYS = frozenset({"pid", "pids", "path", "paths", "file", "files", "traceback",
                          "tracebacks", "exc_info", "stack", "stacktrace", "patch_record",
                          "workers", "model_source", "cwd", "hostname", "ip", "node_ip"})
MAX_TEXT = 500
_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.@+-]+/)*[\w.@+-]+")
_PID = re.compile(r"\b(pid)[=: ]+\d+", re.I)
_TRACEBACK = re.compile(r"Traceback \(most recent call last\):.*", re.S)


def redact_text(text: str) -> str:
    """A report string without tracebacks, absolute paths or process ids, bounded."""
    text = _TRACEBACK.sub("<traceback in the server log>", text)
    text = _PATH.sub("<path>", text)
    text = _PID.sub(r"\1=<hidden>", text)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "..."


def public_report(value: Any) -> Any:
    """The report with what a client must not see removed (recursively)."""
    if isinstance(value, dict):
        return {k: public_report(v) for k, v in value.items()
                if str(k).lower() not in DROPPED_KEYS}
    if isinstance(value, (list, tuple)):
        return [public_report(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


Fetch = Callable[[bool], Awaitable[dict[str, Any]]]


class RefreshGate:
    """One refresh at a time, at most one per ``interval_s``; everyone else shares it."""

    def __init__(self, interval_s: float):
        self._interval = interval_s
        self._running: asyncio.Future[dict[str, Any]] | None = None
        self._last_start = float("-inf")

    async def report(self, refresh: bool, fetch: Fetch) -> tuple[dict[str, Any], str]:
        """(report, how): how is ``cached``, ``ran``, ``coalesced`` or ``rate-limited``."""
        if not refresh:
            return await fetch(False), "cached"
        if self._running is not None and not self._running.done():
            return await asyncio.shield(self._running), "coalesced"
        if time.monotonic() - self._last_start < self._interval:
            return await fetch(False), "rate-limited"
        self._last_start = time.monotonic()
        self._running = asyncio.ensure_future(fetch(True))
        # shield: a client that goes away must not cancel the check the others wait for.
        return await asyncio.shield(self._running), "ran"
