"""The ``kv_pressure`` scaling decision, pure: replica loads in, a replica count out.

``deployments.serving.autoscale`` feeds it from Serve's ``AutoscalingContext`` (the newest
sample each replica pushed from ``record_autoscaling_stats``) and exports what it
decided; this module decides, so tests can run it over sequences of loads and clocks.

The rule (settings: ``deployments.config.autoscaling``):

- capacity is the replicas the KV-spec check has not drained (a drained replica takes no
  requests; Serve's default counts it), and drained ones stay in the target: they are
  kept up to inspect, not replaced by scaling;
- up, when the undrained replicas' mean KV usage >= ``kv_usage_up`` or their waiting
  requests per replica >= ``waiting_up`` (or, when the user set Serve's
  ``target_ongoing_requests``, their running + waiting per replica >= it, as Serve's
  default policy would), for ``upscale_delay_s``: to
  ``ceil(capacity * pressure / threshold)``, at least one more, at most ``max_step_up``
  more; never below a target already raised (a replica still booting is not capacity);
- down, one replica, when the KV in use would fit one replica fewer under
  ``kv_usage_down``, nothing waits, for ``downscale_delay_s`` since both the quiet began
  and the last change. Serve then stops a replica gracefully: it leaves the routers,
  its in-flight requests finish (``graceful_shutdown_timeout_s``), its port closes
  (``serving.stopping``);
- waiting and running are vLLM's counts, raised to Serve's own count of the requests
  the replicas hold (``queue_of``: the engine's counts lag a long step);
- no sample from any replica (none running yet, stats failing): hold;
- a hold keeps the target this rule decided last (``PolicyState.decided``), not Serve's,
  which follows it a tick or more later; a step down waits until Serve's target and
  running replicas both reached the decided one.

Counts are in gangs of ``gang_size`` Serve replicas (DP ranks of one gang).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from deployments.config.autoscaling import AutoscalingSection


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's newest autoscaling sample (``record_autoscaling_stats``)."""

    kv_usage: float = 0.0  # vLLM's kv_cache_usage_perc, 0..1
    waiting: float = 0.0
    running: float = 0.0
    drained: bool = False


@dataclass(frozen=True)
class PolicyState:
    """What the rule remembers between calls (kept in Serve's ``policy_state``)."""

    pressure_since: float | None = None
    quiet_since: float | None = None
    last_change: float | None = None
    decided: int | None = None  # the target last returned: Serve's may lag behind it

    def to_dict(self) -> dict[str, float | int | None]:
        return {"pressure_since": self.pressure_since, "quiet_since": self.quiet_since,
                "last_change": self.last_change, "decided": self.decided}

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> PolicyState:
        def num(key: str) -> float | None:
            value = raw.get(key)
            return float(value) if isinstance(value, int | float) else None
        decided = num("decided")
        return cls(num("pressure_since"), num("quiet_since"), num("last_change"),
                   None if decided is None else int(decided))


@dataclass(frozen=True)
class Observation:
    """What one decision sees."""

    now: float
    target: int  # Serve's current target (replicas)
    running: int  # replicas Serve runs now
    loads: dict[str, ReplicaLoad] = field(default_factory=dict)  # replicas with a sample
    lowest: int = 1
    highest: int = 1
    # Serve's own count of the deployment's requests (at its replicas and queued at its
    # handles: ``AutoscalingContext.total_num_requests``), None when not known.
    requests: float | None = None


@dataclass(frozen=True)
class Decision:
    target: int
    reason: str  # kv_pressure|queue_pressure|ongoing_requests|quiet|hold|no_metrics|bounds
    capacity: int  # undrained replicas
    kv_usage: float  # mean over undrained replicas with a sample
    waiting_per_replica: float
    state: PolicyState


def decide(obs: Observation, settings: AutoscalingSection, state: PolicyState,
           gang_size: int = 1, target_ongoing: float | None = None) -> Decision:
    """The target replica count for ``obs`` (see the module docstring); a
    ``target_ongoing`` (the user's ``autoscaling_config.target_ongoing_requests``) is a
    third pressure: requests running and waiting per undrained replica over it.

    Every answer starts from the target this rule decided last (``state.decided``), not
    Serve's: Serve applies a decision through its own wrapper (delays, scaling factors)
    and its replicas follow later, and a hold that returned Serve's older target undid
    the step (a quiet 2 -> 1, then a hold at 2)."""
    decided = state.decided if state.decided is not None else obs.target
    serving = {k: v for k, v in obs.loads.items() if not v.drained}
    drained = len(obs.loads) - len(serving)
    capacity = max(obs.running - drained, 0)

    def answer(target: int, reason: str, kv: float, waiting: float,
               new: PolicyState) -> Decision:
        return _bounded(obs, target, reason, capacity, kv, waiting, new, gang_size)

    if not serving:
        return answer(decided, "no_metrics", 0.0, 0.0,
                      replace(state, pressure_since=None, quiet_since=None))
    kv = sum(v.kv_usage for v in serving.values()) / len(serving)
    waiting_all, ongoing_all = queue_of(serving, obs.requests)
    waiting, ongoing = waiting_all / len(serving), ongoing_all / len(serving)
    pressures = {"kv_pressure": kv / settings.kv_usage_up,
                 "queue_pressure": waiting / settings.waiting_up,
                 "ongoing_requests": ongoing / target_ongoing if target_ongoing else 0.0}
    pressure = max(pressures.values())
    if pressure >= 1.0:
        since = state.pressure_since if state.pressure_since is not None else obs.now
        state = replace(state, pressure_since=since, quiet_since=None)
        if obs.now - since < settings.upscale_delay_s:
            return answer(decided, "hold", kv, waiting, state)
        base = max(capacity, 1)
        wanted = max(base + 1, math.ceil(base * pressure))
        wanted = min(wanted, base + settings.max_step_up * gang_size) + drained
        reason = max(pressures, key=lambda name: pressures[name])
        decision = answer(max(wanted, decided), reason, kv, waiting, state)
        if decision.target > decided:
            decision = replace(decision, state=replace(decision.state, last_change=obs.now))
        return decision
    state = replace(state, pressure_since=None)
    fewer = capacity - gang_size
    left = len(serving) - gang_size  # the KV in use, spread over one gang fewer
    quiet = fewer >= 1 and left > 0 and waiting_all == 0 \
        and kv * len(serving) / left < settings.kv_usage_down \
        and (not target_ongoing or ongoing * len(serving) / left < target_ongoing)
    under_way = obs.target != decided or obs.running != decided  # Serve not there yet
    if not quiet or under_way:
        return answer(decided, "hold", kv, waiting, replace(state, quiet_since=None))
    since = state.quiet_since if state.quiet_since is not None else obs.now
    state = replace(state, quiet_since=since)
    last = state.last_change if state.last_change is not None else -math.inf
    if min(obs.now - since, obs.now - last) < settings.downscale_delay_s:
        return answer(decided, "hold", kv, waiting, state)
    state = replace(state, quiet_since=None, last_change=obs.now)
    return answer(min(decided, fewer + drained), "quiet", kv, waiting, state)


def queue_of(serving: dict[str, ReplicaLoad], requests: float | None) -> tuple[float, float]:
    """(requests waiting, requests held) over the undrained replicas.

    vLLM sets its running/waiting gauges once per engine step; a step that prefills a
    batch can take a minute on a CPU (seconds on a loaded GPU), and until it ends the
    engine's counts say nothing of the requests that came meanwhile. Serve counts every
    request its replicas hold when it arrives: what the engine does not yet run is
    waiting, so the larger of the two counts stands (measured here: with vLLM's counts
    alone, a 16-stream step on one CPU replica was seen after 108 s, Serve's default after
    43 s with its 30 s delay)."""
    running = sum(v.running for v in serving.values())
    waiting = sum(v.waiting for v in serving.values())
    if requests is None:
        return waiting, running + waiting
    return max(waiting, requests - running), max(running + waiting, requests)


def _bounded(obs: Observation, target: int, reason: str, capacity: int, kv: float,
             waiting: float, state: PolicyState, gang_size: int) -> Decision:
    """Whole gangs, inside Serve's (capacity-adjusted) bounds."""
    target = math.ceil(target / gang_size) * gang_size
    bounded = min(max(target, obs.lowest), obs.highest)
    if bounded != target and reason in ("kv_pressure", "queue_pressure", "ongoing_requests",
                                        "quiet"):
        reason = "bounds"
    return Decision(bounded, reason, capacity, kv, waiting, replace(state, decided=bounded))
