"""The patch record: what dsv4_patch did in this process, readable by code and logs.

Kept pure (no vLLM import) so the worker extension, the Serve replica and the
doctor can all read it and ship it across processes as plain JSON.
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass, field
from typing import Literal

# pending: waiting for the target module to be imported (DSv4 not built yet here).
# error: the probe could not run on this vLLM; the target was left unchanged.
Status = Literal["pending", "applied", "skipped", "error"]


@dataclass(frozen=True)
class PatchResult:
    """Outcome of one documented patch in this process."""

    name: str
    status: Status
    reason: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class PatchRecord:
    """Everything the plugin did in one process; filled once, then read-only."""

    vllm_version: str | None = None
    platform: str | None = None
    pid: int = field(default_factory=os.getpid)
    results: list[PatchResult] = field(default_factory=list)

    def set(self, result: PatchResult) -> None:
        """Add ``result``, replacing an earlier entry of the same patch (pending -> final)."""
        self.results = [r for r in self.results if r.name != result.name]
        self.results.append(result)

    def result_of(self, name: str) -> PatchResult | None:
        return next((r for r in self.results if r.name == name), None)

    def status_of(self, name: str) -> Status | None:
        return next((r.status for r in self.results if r.name == name), None)

    def as_dict(self) -> dict[str, object]:
        return {
            "vllm_version": self.vllm_version,
            "platform": self.platform,
            "pid": self.pid,
            "patches": [r.as_dict() for r in self.results],
        }

    def summary(self) -> str:
        """One log line: what was applied, what was skipped and why."""
        parts = [f"{r.name}={r.status} ({r.reason})" for r in self.results]
        return f"dsv4_patch on vLLM {self.vllm_version} [{self.platform}]: " + "; ".join(parts)


_lock = threading.Lock()
_record: PatchRecord | None = None


def current() -> PatchRecord | None:
    """The record of this process, or None when the plugin has not run here."""
    return _record


def publish(record: PatchRecord) -> None:
    """Make ``record`` the process record (called once by the plugin)."""
    global _record
    with _lock:
        _record = record
