"""Which replica a session's request goes to: pure, for the router and its tests.

Rendezvous (highest-random-weight) hashing over the undrained, engine-alive replicas:
each (key, replica) pair gets a stable score and the highest wins, so a replica joining
or leaving moves only the sessions it wins or held (like a consistent-hash ring, without
one to rebuild on each replica-set change: O(replicas) per request, a few replicas).
``None`` means "no preference": the caller routes as it would without affinity (power
of two among the undrained), which is also what happens when the guard trips.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from deployments.config.routing import RoutingSection


@dataclass(frozen=True)
class Candidate:
    """A replica as the router knows it from its routing stats (no call to ask)."""

    replica_id: str
    load: float = 0.0  # requests the replica holds (its edge's in-flight count)
    kv_usage: float = 0.0  # vLLM's kv_cache_usage_perc, 0..1
    drained: bool = False
    engine_dead: bool = False


def score(key: str, replica_id: str) -> int:
    """The stable weight of (key, replica): blake2b, not Python's salted hash()."""
    digest = hashlib.blake2b(f"{key}\x00{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def preferred(key: str, candidates: list[Candidate]) -> Candidate | None:
    """The session's replica among those that may serve, ignoring load."""
    usable = [c for c in candidates if not c.drained and not c.engine_dead]
    return max(usable, key=lambda c: score(key, c.replica_id), default=None)


def choose(key: str | None, candidates: list[Candidate],
           settings: RoutingSection) -> tuple[Candidate | None, str]:
    """(the replica for this request or None for the usual routing, why)."""
    if not settings.affinity or not key:
        return None, "no_key"
    pick = preferred(key, candidates)
    if pick is None:
        return None, "none_serving"  # fail open: the caller's own rules decide
    if pick.kv_usage >= settings.kv_full:
        return None, "kv_full"
    usable = [c for c in candidates if not c.drained and not c.engine_dead]
    least = min(c.load for c in usable)
    if pick.load > settings.busier_ratio * least + settings.busier_slack:
        return None, "busier"
    return pick, "affinity"
