"""``KVSpecRouter``: Serve's power-of-two-choices routing that skips drained replicas,
with session affinity.

Policy ``drain`` keeps an odd replica up (its engine, logs and KV spec stay there
to inspect) but sends it no new requests. That is a routing decision, so it is
made where Ray Serve LLM makes its own (``ray.serve.llm.request_router``'s
prefix-aware and KV-aware routers): a ``ray.serve.request_router.RequestRouter``
set in the server deployment's ``request_router_config``. No proxy of our own.

How a router learns who is drained: each replica's ``record_routing_stats()``
(``deployments.control.enforcement.drain_stats``) returns ``dsv4_kv_drain``; Serve's
controller polls it every ``request_routing_stats_period_s`` and ships it to
every router with the replica set (``RunningReplica.routing_stats``).

The router fails open: if every candidate is drained it routes among them
anyway (and says so in the log) -- draining never takes the whole fleet down. It
never pins a request to one replica: Responses state lives in the fleet's store
(``deployments.responses``), so any replica serves any follow-up, and no request
waits for a replica that Serve stopped routing to.

Session affinity (``dsv4.routing``, ``serving.affinity``): a request with an
``x-session-id`` header (Serve's proxy puts it in ``RequestMetadata.session_id`` before
the body is read) goes to its session's replica among the undrained, engine-alive ones,
unless that one's KV is nearly full or it is much busier than the least-loaded (then,
and without a header, power of two as above). Everything it reads is in the routing
stats Serve already shipped (KV usage, in-flight, drained, engine dead): no call in the
router loop. Any error in the affinity choice falls back to power of two, logged once.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from deployments.config.routing import RoutingSection
from deployments.control.wire import (
    DRAIN_STAT,
    ENGINE_DEAD_STAT,
    HTTP_IN_FLIGHT_STAT,
    KV_USAGE_STAT,
)
from deployments.logs import get_logger
from deployments.serving.affinity import Candidate, choose

logger = get_logger("router")

ROUTER_CLASS = "deployments.serving.router.KVSpecRouter"
# How often replicas report whether they are drained (Serve's default is 10 s).
ROUTING_STATS_PERIOD_S = 2.0


def router_config(routing: RoutingSection | None = None) -> dict[str, Any]:
    """The server deployment's ``request_router_config`` (Serve deployment option)."""
    return {"request_router_class": ROUTER_CLASS,
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
            "request_router_kwargs": (routing or RoutingSection()).router_kwargs()}


def with_kv_router(deployment_config: dict[str, Any],
                   routing: RoutingSection | None = None) -> dict[str, Any]:
    """``deployment_config`` with our router, or a named error if another one is set."""
    current = deployment_config.get("request_router_config")
    if current is not None:
        cls = current.get("request_router_class") if isinstance(current, dict) else current
        if cls != ROUTER_CLASS:
            raise ValueError(
                f"llm.deployment_config.request_router_config.request_router_class={cls!r}: "
                f"policy drain (and enforce once it gives up) needs {ROUTER_CLASS!r} to keep "
                "requests off odd replicas. Fix: remove request_router_config (dsv4-serve "
                "sets it)."
            )
    return deployment_config | {"request_router_config": router_config(routing)}


def drained(replica: RunningReplica) -> bool:
    return bool((replica.routing_stats or {}).get(DRAIN_STAT))


def candidate(replica: RunningReplica) -> Candidate:
    """What the affinity choice knows of a replica: its last routing stats."""
    stats = replica.routing_stats or {}
    return Candidate(replica.replica_id.unique_id, float(stats.get(HTTP_IN_FLIGHT_STAT, 0)),
                     float(stats.get(KV_USAGE_STAT, 0.0)), bool(stats.get(DRAIN_STAT)),
                     bool(stats.get(ENGINE_DEAD_STAT)))


class KVSpecRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Two random candidates among the replicas not drained by the KV-spec check.

    The candidates of Serve's default ``PowerOfTwoChoicesRequestRouter`` (multiplexed
    model ids first, then locality), with drained replicas removed from every candidate
    set before the two are drawn. Without its ``FIFOMixin``: that mixin hands the replica
    chosen for one request to the oldest pending one, so with several sessions' turns
    pending a session's replica would serve another session's turn. A replica chosen
    here goes to the request it was chosen for, as in Ray's own affinity routers
    (``ConsistentHashRouter``, ``PrefixCacheAffinityRouter``).
    """

    _warned_all_drained = False
    _warned_affinity = False
    _routing = RoutingSection()

    def initialize_state(self, **kwargs: Any) -> None:
        """``request_router_kwargs``: ``dsv4.routing`` (validated again here)."""
        self._routing = RoutingSection(**kwargs)

    def affine(self, candidates: list[RunningReplica],
               pending_request: PendingRequest | None) -> RunningReplica | None:
        """The session's replica among ``candidates``, or None for power of two (fails
        open, logged once)."""
        key = pending_request.metadata.session_id if pending_request is not None else ""
        if not key or not self._routing.affinity:
            return None
        try:
            replicas = list(candidates)
            pick, _why = choose(key, [candidate(r) for r in replicas], self._routing)
        except Exception:  # never fail a request over affinity: route as without it
            if not self._warned_affinity:
                logger.exception("dsv4: session affinity failed; routing by power of two")
                self._warned_affinity = True
            return None
        if pick is None:
            return None
        return next(r for r in replicas if r.replica_id.unique_id == pick.replica_id)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        session = self.affine(candidate_replicas, pending_request)
        spread = self.power_of_two(pending_request)
        # The session's replica first; if it turns the request away (full), the usual two.
        return ([[session]] if session is not None else []) + spread

    def power_of_two(self, pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        """Two random undrained replicas (multiplexed model ids first, then locality)."""
        if pending_request is not None and pending_request.metadata.multiplexed_model_id:
            ids = self.apply_multiplex_routing(pending_request=pending_request)
        else:
            ids = self.apply_locality_routing(pending_request=pending_request)
        replicas = self.curr_replicas
        pool = [replicas[i] for i in ids if i in replicas]
        serving = [r for r in pool if not drained(r)]
        if not serving:
            # Locality may have offered only drained replicas: widen to all first.
            serving = [r for r in replicas.values() if not drained(r)]
        if not serving:
            if pool and not self._warned_all_drained:
                logger.warning("dsv4: every replica is drained by the KV-spec check; "
                               "routing to drained replicas rather than to none")
                self._warned_all_drained = True
            serving = pool
        else:
            self._warned_all_drained = False
        if not serving:
            return []
        return [random.sample(serving, min(2, len(serving)))]
