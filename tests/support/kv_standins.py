"""Test-only controller variants, importable by Ray workers (``tests`` is a package)."""

from __future__ import annotations

import time
from pathlib import Path

from deployments.control.controller import KVSpecController

# While this file exists, the first StuckStatusController's serve.status() never returns.
STUCK_FLAG = Path("/tmp/dsv4-test-stuck-status")
# While this file exists, a stand-in given ``hang_flag`` stalls its kv_page_spec answers.
HANG_FLAG = Path("/tmp/dsv4-test-hung-replica")


class StuckStatusController(KVSpecController):
    """The real controller whose ``serve.status()`` call blocks like a wedged GCS/controller.

    Only the ``serve.status()`` call is replaced (the one dependency the issue says can
    hang): collection, judging, staleness and health are the real code.
    """

    async def _running(self) -> tuple[int | None, str | None]:
        if STUCK_FLAG.exists():
            self._stuck = True
        return await super()._running()

    def _status_target(self, app: str, deployment: str) -> int | None:
        if getattr(self, "_stuck", False):
            time.sleep(3600)  # a status call that never returns (its thread is left behind)
        return super()._status_target(app, deployment)
