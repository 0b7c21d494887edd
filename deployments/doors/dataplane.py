"""Under ``http.ingress: haproxy``: a replica the KV-spec check drains leaves HAProxy's
rotation.

Why: Ray 2.60 refuses our ``KVSpecRouter`` on an ingress deployment under HAProxy
(``serve._private.build_app``); HAProxy picks the replica itself, among the servers
whose ``/-/healthz`` on their direct-ingress port answers 200 (checked every
``RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER``, 5 s, down after ``..._FALL``, 2, failures).
Serve answers that path from ``Replica._dataplane_health_check``: 503 while the replica
shuts down or its user health check (the engine) fails, never for a KV-spec drain.

How: this replica's ``Replica`` instance (reached as ``deployments.doors.stopping``
reaches it) gets an instance-level wrapper of that method: Serve's own answer first,
then 503 "DRAINED" while ``DataplaneGate.drained`` is set. The server sets it from its
verdict, failing open like the router: never when no other replica would serve. Ray
touch ``serve.dataplane_health`` (deployments.ray_touches); absent, the replica says
so and keeps serving under HAProxy while drained (logged at every drain).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from deployments.doors.stopping import touched_replica
from deployments.logs import get_logger

logger = get_logger("server")

TOUCH = "serve.dataplane_health"
DRAINED_MESSAGE = "DRAINED by the dsv4 KV-spec check"
HealthCheck = Callable[[], Coroutine[Any, Any, tuple[bool, str]]]


class DataplaneGate:
    """What this replica's ``/-/healthz`` adds to Serve's answer: drained or not."""

    def __init__(self) -> None:
        self.drained = False

    def follow(self, drained: bool) -> None:
        """Take the verdict's drain (already failed open by the caller); log a change."""
        if drained != self.drained:
            logger.warning("dsv4: %s HAProxy's rotation: /-/healthz now answers %s",
                           "leaving" if drained else "back in",
                           "503 DRAINED" if drained else "Serve's own health")
        self.drained = drained

    def wrap(self, original: HealthCheck) -> HealthCheck:
        """Serve's health check, then 503 while drained."""
        async def check() -> tuple[bool, str]:
            healthy, message = await original()
            if healthy and self.drained:
                return False, DRAINED_MESSAGE
            return healthy, message
        return check


def install() -> DataplaneGate | None:
    """A gate on this replica's data-plane health check, or None (logged) when this Ray
    or process does not let us reach it."""
    replica = touched_replica(TOUCH, "_dataplane_health_check", "under HAProxy a drained "
                              "replica keeps receiving requests")
    if replica is None:
        return None
    gate = DataplaneGate()
    replica._dataplane_health_check = gate.wrap(replica._dataplane_health_check)
    return gate
