"""The installed vLLM's own layout decision, taken while the engine process boots.

Where ``dsv4_patch.node.table_decision`` decided the layout from the release table
(a CPU node), asking vLLM's own attention class imports its DeepSeek-V4 model package
(~1 s of this process's one interpreter). Done before the engine starts, that second
sits on every replica's boot; done once the engine process exists, it overlaps the
engine's own ~15 s start. The replica awaits the answer before it serves and refuses
on a contradiction (the workers' own report is checked against the layout after
that as well: ``DSv4Server._self_check``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import psutil

from dsv4_patch import rules
from dsv4_patch.node import NodeInfo, layout_contradiction

ENGINE_WAIT_S = 10.0  # then ask anyway: the engine may be started some other way
POLL_S = 0.02


class DeferredLayoutCheck:
    """``layout_contradiction(node, decided)`` in a thread, started once this process
    has a child (the engine core) or after ``wait_s``."""

    def __init__(self, node: NodeInfo, decided: rules.LayoutDecision,
                 wait_s: float = ENGINE_WAIT_S) -> None:
        self._node, self._decided, self._wait_s = node, decided, wait_s
        self._future: concurrent.futures.Future[str | None] = concurrent.futures.Future()
        threading.Thread(target=self._run, name="dsv4-layout-check", daemon=True).start()

    def _run(self) -> None:
        me, deadline = psutil.Process(), time.monotonic() + self._wait_s
        while not me.children() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        try:
            self._future.set_result(layout_contradiction(self._node, self._decided))
        except BaseException as exc:  # re-raised in the replica by contradiction()
            self._future.set_exception(exc)

    async def contradiction(self) -> str | None:
        """What the installed vLLM builds instead of the decided layout, or None."""
        return await asyncio.wrap_future(self._future)
