"""Which prefill replicas this decode replica may hand a request to, and the router that obeys.

The decode replica calls the prefill deployment through its handle, so the prefill
deployment's request router runs *inside the decode replica's process*. The
controller sends every decode replica its whitelist (``wire.PDRouteMessage``:
``apply_pd_route``); the replica keeps it here, one per process (a Serve replica is
one actor), and ``PDPrefillRouter`` draws only from it. Until the first P/D check the
whitelist is empty: no KV moves between replicas not yet proven compatible, and the
decode replica prefills on its own engine (``may_transfer`` is False).
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import PendingRequest, RunningReplica

from deployments.control.wire import PDRouteMessage, PDVerdict
from deployments.logs import get_logger
from deployments.serving.router import ROUTING_STATS_PERIOD_S, KVSpecRouter, drained

logger = get_logger("pd")

PD_ROUTER_CLASS = "deployments.pd.route.PDPrefillRouter"


@dataclass
class Route:
    """This process's whitelist of prefill replica ids (None: not checked yet)."""

    check: bool = True
    allowed: frozenset[str] | None = None
    verdict: PDVerdict = PDVerdict.NOT_CHECKED
    checked_at: float | None = None
    # Canary request id -> the one prefill replica it must go to (whitelisted or not:
    # a pair is canaried before it joins the whitelist).
    pins: dict[str, str] = field(default_factory=dict)

    def may_transfer(self) -> bool:
        """True when a request may go through a prefill replica at all."""
        return not self.check or bool(self.allowed)

    def permits(self, replica_id: str) -> bool:
        return not self.check or (self.allowed is not None and replica_id in self.allowed)


ROUTE = Route()


def take(message: PDRouteMessage, decode_replica: str) -> Route:
    """Apply the controller's message for ``decode_replica``; log when it changes."""
    allowed = frozenset(message.allowed.get(decode_replica, []))
    if allowed != ROUTE.allowed:
        log = logger.info if allowed else logger.warning
        log("dsv4: P/D %s: decode replica %s may take KV from prefill replicas %s%s",
            message.verdict.value, decode_replica, sorted(allowed),
            "" if allowed else " (none: it prefills on its own engine)")
    ROUTE.allowed, ROUTE.verdict, ROUTE.checked_at = allowed, message.verdict, \
        message.checked_at
    return ROUTE


CANARY_PREFIX = "dsv4-canary-"


def pinned(pending: Any, route: Route) -> str | None:
    """The prefill replica a canary request is pinned to, or None for any other request.

    The decode replica's canary sets the request id of its ``CompletionRequest``; Ray's
    P/D orchestrator deep-copies the request for the prefill call, so the id reaches
    the handle call's first argument, which this router sees.
    """
    args = getattr(pending, "args", None) or ()
    request_id = getattr(args[0], "request_id", None) if args else None
    if not isinstance(request_id, str) or not request_id.startswith(CANARY_PREFIX):
        return None
    return route.pins.get(request_id)


def live_route() -> Route:
    """This process's ``ROUTE``, looked up in the imported module at call time.

    Serve ships the router class to the process that routes (cloudpickle); a class
    carried by value would hold its own copy of this module's globals, frozen at
    deploy time (measured: the router saw no whitelist while the replica had one).
    """
    return importlib.import_module(__name__).ROUTE


def router_config() -> dict[str, object]:
    """The prefill deployment's ``request_router_config``."""
    return {"request_router_class": PD_ROUTER_CLASS,
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}


class PDPrefillRouter(KVSpecRouter):
    """Two random candidates among the prefill replicas this decode replica may use.

    Unlike ``KVSpecRouter`` it never fails open: a prefill replica not proven
    compatible would hand over pages the decode engine misreads. When no permitted
    replica is up the request waits in Serve's queue (the decode replica sends none
    while its whitelist is empty).
    """

    _warned_none = False

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        route = live_route()
        pin = pinned(pending_request, route)
        if pin is not None:
            logger.debug("dsv4: canary request pinned to prefill replica %s", pin)
            only = [r for r in self.curr_replicas.values() if r.replica_id.unique_id == pin]
            return [only] if only else []  # gone: the canary waits, then times out
        if not route.check:
            return await super().choose_replicas(candidate_replicas, pending_request)
        pool = [r for r in self.curr_replicas.values()
                if route.permits(r.replica_id.unique_id)]
        serving = [r for r in pool if not drained(r)] or pool
        if not serving:
            if not self._warned_none:
                logger.warning("dsv4: no prefill replica of %s is permitted for this decode "
                               "replica right now; the request waits", sorted(
                                   route.allowed or ()))
                self._warned_none = True
            return []
        self._warned_none = False
        return [random.sample(serving, min(2, len(serving)))]
