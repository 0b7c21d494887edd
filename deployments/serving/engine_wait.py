"""Work a replica does while its engine process boots, instead of before or after it.

From the moment the engine core process exists until the engine answers (~15 s on a
2-core box), the replica's own interpreter waits. Two jobs that sat on its boot path
run there instead, in order, on one thread (``AfterEngineSpawn``):

* the installed vLLM's own DeepSeek-V4 layout answer where the release table decided
  the engine's dtype (``dsv4_patch.node.table_decision``, a CPU node): importing the
  model package to ask it costs ~1 s before the engine could start. The replica
  awaits the answer before it serves and refuses on a contradiction.
* a full collection and freeze of the GC heap (``freeze_heap``): vLLM's app lifespan
  does the same (``vllm.utils.gc_utils.freeze_gc_heap``) before its first answer,
  ~0.4 s over a replica's heap (Ray, Serve and vLLM); done first, the lifespan's own
  collection sees only what came since.
"""

from __future__ import annotations

import concurrent.futures
import gc
import time
from collections.abc import Callable
from typing import TypeVar

import psutil

from deployments.logs import get_logger

logger = get_logger("server")

ENGINE_WAIT_S = 10.0  # then run anyway: the engine may be started some other way
POLL_S = 0.02
T = TypeVar("T")


def wait_for_a_child(wait_s: float, poll_s: float = POLL_S) -> bool:
    """Until this process has a child (the engine core) or ``wait_s`` passed."""
    me, deadline = psutil.Process(), time.monotonic() + wait_s
    while not me.children():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


class AfterEngineSpawn:
    """A one-thread queue whose jobs start once this process has a child, or after
    ``wait_s``; each job's result (or exception) in its future."""

    def __init__(self, wait_s: float = ENGINE_WAIT_S) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="dsv4-while-engine-starts")
        self.spawned = self._pool.submit(wait_for_a_child, wait_s)

    def submit(self, name: str, job: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue ``job``; a failure is logged here and kept in the future."""
        def logged() -> T:
            try:
                return job()
            except BaseException:
                logger.exception("dsv4: %s, run while the engine started, failed", name)
                raise
        return self._pool.submit(logged)

    def close(self) -> None:
        """No more jobs; those queued still run."""
        self._pool.shutdown(wait=False)


def freeze_heap() -> int:
    """Collect every generation and freeze what survives, as vLLM's lifespan does;
    return the objects frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("dsv4: froze %d heap objects while the engine started (vLLM's app "
                "lifespan then collects only what came since)", frozen)
    return frozen
