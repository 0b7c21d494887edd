"""The decode replica's count of failed KV transfers, read from vLLM's own NIXL counter.

vLLM's NIXL connector counts every READ it could not post or complete, every failed
handshake and every failed notification (``NixlKVConnectorStats``: ``record_failed_*``;
a READ that raises reaches ``_handle_failed_transfer``, which records it), and its
Prometheus side adds them into one counter, ``vllm:nixl_num_failed_transfers``
(``NixlPromMetrics.observe``). Under Ray Serve LLM (``log_engine_metrics``) that counter
is built in the replica process by ``RayKVConnectorProm._counter_cls``, which is vLLM's
``RayCounterWrapper``: it goes to Ray's metrics agent and nothing in the process can read
it back.

``install`` (before the engine starts; the ray touch ``llm.nixl_failed_transfers``) makes
that class ``TalliedCounter``: every increment still goes to Ray's counter unchanged, and
the increments of ``vllm:nixl_num_failed_transfers`` are also added up here.
``reading`` gives the total since the replica started, which the decode replica reports
to the controller with each whitelist it takes (``wire.PDRouteAck``), or why it has none.
vLLM's ``vllm.stat_logger_plugins`` entry point is not used: any plugin there turns on
``log_stats`` for every vLLM engine in the environment (``AsyncLLM.__init__``).
"""

from __future__ import annotations

import threading

from deployments import ray_touches
from deployments.logs import get_logger

logger = get_logger("pd")

TOUCH = "llm.nixl_failed_transfers"
# The counter vLLM's NixlPromMetrics adds failed transfers, handshakes and notifications
# into (vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py).
TALLIED = "vllm:nixl_num_failed_transfers"


class Tally:
    """The failed transfers counted in this process, and whether vLLM built the counter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0.0
        self.built = False

    def add(self, value: float) -> None:
        with self._lock:
            self.total += value


TALLY = Tally()
_state = {"installed": False, "why": "not installed: the decode replica has not started"}


def counter_class() -> type:
    """``TalliedCounter``: the installed vLLM's ``RayCounterWrapper``, plus the tally."""
    from vllm.v1.metrics.ray_wrappers import RayCounterWrapper

    class TalliedCounter(RayCounterWrapper):
        """``RayCounterWrapper`` (Ray's counter, vLLM's labels), unchanged for Ray; the
        increments of ``TALLIED`` are also added to ``TALLY``."""

        def __init__(self, name: str, documentation: str | None = "",
                     labelnames: list[str] | None = None) -> None:
            super().__init__(name, documentation, labelnames)
            self._tallied = name == TALLIED
            if self._tallied:
                TALLY.built = True

        def inc(self, value: int | float = 1.0) -> None:
            if self._tallied and value:
                TALLY.add(float(value))
            super().inc(value)

    return TalliedCounter


def install() -> bool:
    """Before the engine starts: vLLM's Ray KV-connector metrics build their counters as
    ``TalliedCounter``. False (logged) when the touch is absent in this vLLM."""
    if not ray_touches.present(TOUCH):
        _state["why"] = (f"vLLM's NIXL failure counter is not where dsv4-serve expects it "
                         f"(ray touch {TOUCH}, dsv4-serve doctor)")
        logger.warning("dsv4: %s: this decode replica's failed KV transfers are not read",
                       _state["why"])
        return False
    from vllm.v1.metrics import ray_wrappers

    if not getattr(ray_wrappers.RayKVConnectorProm._counter_cls, "dsv4_tallied", False):
        cls = counter_class()
        cls.dsv4_tallied = True  # type: ignore[attr-defined]  # marks ours (idempotent install)
        ray_wrappers.RayKVConnectorProm._counter_cls = cls
    _state["installed"] = True
    return True


def reading(log_engine_metrics: bool | None) -> tuple[int | None, str | None]:
    """(failed KV transfers this replica's engine counted since it started, None), or
    (None, why they cannot be read)."""
    if not _state["installed"]:
        return None, str(_state["why"])
    if log_engine_metrics is False:
        return None, ("llm.log_engine_metrics is false: Ray Serve LLM gives the engine no "
                      "Ray stat logger, so vLLM builds no vllm:nixl_num_failed_transfers. "
                      "Fix: unset llm.log_engine_metrics (Ray's default is true)")
    if not TALLY.built:
        return None, (f"vLLM built no {TALLIED} counter in this replica (no NIXL "
                      "connector, or the engine's stat loggers are not Ray's)")
    return int(TALLY.total), None
