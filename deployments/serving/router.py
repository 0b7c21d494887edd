"""``KVSpecRouter``: Serve's power-of-two-choices routing that skips drained replicas.

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
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from deployments.control.wire import DRAIN_STAT
from deployments.logs import get_logger

logger = get_logger("router")

ROUTER_CLASS = "deployments.serving.router.KVSpecRouter"
# How often replicas report whether they are drained (Serve's default is 10 s).
ROUTING_STATS_PERIOD_S = 2.0


def router_config() -> dict[str, Any]:
    """The server deployment's ``request_router_config`` (Serve deployment option)."""
    return {"request_router_class": ROUTER_CLASS,
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}


def with_kv_router(deployment_config: dict[str, Any]) -> dict[str, Any]:
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
    return deployment_config | {"request_router_config": router_config()}


def drained(replica: RunningReplica) -> bool:
    return bool((replica.routing_stats or {}).get(DRAIN_STAT))


class KVSpecRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """Two random candidates among the replicas not drained by the KV-spec check.

    The same procedure as Serve's default ``PowerOfTwoChoicesRequestRouter``
    (multiplexed model ids first, then locality), with drained replicas removed
    from every candidate set before the two are drawn.
    """

    _warned_all_drained = False

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
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
