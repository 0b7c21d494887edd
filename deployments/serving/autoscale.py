"""``KVPressurePolicy``: Serve's autoscaling on KV usage and queue depth, and its wiring.

Ray 2.60's custom policy mechanism (public: ``ray.serve.config.AutoscalingPolicy``):
``autoscaling_config.policy = {policy_function: "deployments.serving.autoscale:
KVPressurePolicy", policy_kwargs: {...}}``; Serve's controller builds the class once with
the kwargs and calls it each control-loop tick with an ``AutoscalingContext`` whose
``raw_metrics`` carry what each replica's ``record_autoscaling_stats()`` returned
(``stats``), sampled every ``look_back_period_s * 0.2`` and pushed every
``metrics_interval_s``. The decision itself is ``autoscale_rule.decide``; this class
turns the context into its input, keeps its state in Serve's ``policy_state``, and sets
the ``dsv4_autoscale_*`` series and logs a line whenever the decision changes.
"""

from __future__ import annotations

from typing import Any

from deployments.config.autoscaling import POLICY_FUNCTION, AutoscalingSection
from deployments.logs import get_logger
from deployments.observe import series
from deployments.serving.autoscale_rule import (
    Decision,
    Observation,
    PolicyState,
    ReplicaLoad,
    decide,
)

logger = get_logger("autoscale")

# The keys a server replica's record_autoscaling_stats() returns (numbers only: Serve
# disables custom stats on any other value type).
KV_USAGE = "dsv4_kv_usage"
WAITING = "dsv4_waiting"
RUNNING = "dsv4_running"
DRAINED = "dsv4_drained"
# Ray's agent drops a gauge not set for two export intervals (~20 s): the series are set
# again this often while the decision stands.
KEEP_ALIVE_S = 5.0
REASONS = ("kv_pressure", "queue_pressure", "ongoing_requests", "quiet", "hold",
           "no_metrics", "bounds")


def stats(kv_usage: float, waiting: float, running: float, drained: bool) -> dict[str, float]:
    """A replica's autoscaling sample."""
    return {KV_USAGE: float(kv_usage), WAITING: float(waiting), RUNNING: float(running),
            DRAINED: 1.0 if drained else 0.0}


def newest(raw: dict[str, dict[Any, list[Any]]] | None) -> dict[str, ReplicaLoad]:
    """Each replica's newest sample, by replica unique id (replicas without one left out)."""
    values: dict[str, dict[str, float]] = {}
    for name, per_replica in (raw or {}).items():
        for replica, series_ in per_replica.items():
            if series_:
                last = max(series_, key=lambda point: point.timestamp)
                values.setdefault(getattr(replica, "unique_id", str(replica)), {})[name] = \
                    float(last.value)
    return {rid: ReplicaLoad(v.get(KV_USAGE, 0.0), v.get(WAITING, 0.0), v.get(RUNNING, 0.0),
                             v.get(DRAINED, 0.0) >= 0.5)
            for rid, v in values.items() if KV_USAGE in v}


class KVPressurePolicy:
    """Built by Serve's controller with ``AutoscalingSection.policy_kwargs``."""

    def __init__(self, gang_size: int = 1, target_ongoing_requests: float | None = None,
                 **settings: Any) -> None:
        self.settings = AutoscalingSection(**settings)
        self.gang_size = gang_size
        self.target_ongoing = target_ongoing_requests
        self._last: tuple[int, str] | None = None
        self._last_set = 0.0
        self._metrics: dict[str, Any] | None = None

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        obs = Observation(now=float(ctx.current_time), target=int(ctx.target_num_replicas),
                          running=int(ctx.current_num_replicas),
                          loads=newest(ctx.raw_metrics),
                          lowest=int(ctx.capacity_adjusted_min_replicas),
                          highest=int(ctx.capacity_adjusted_max_replicas),
                          requests=serve_requests(ctx))
        state = PolicyState.from_dict(ctx.policy_state or {})
        before = state.decided if state.decided is not None else obs.target
        decision = decide(obs, self.settings, state, self.gang_size, self.target_ongoing)
        changed = self._last != (decision.target, decision.reason)
        if changed or obs.now - self._last_set >= KEEP_ALIVE_S:
            self._report(ctx, obs, decision, changed, before)
            self._last, self._last_set = (decision.target, decision.reason), obs.now
        return decision.target, decision.state.to_dict()

    def _report(self, ctx: Any, obs: Observation, decision: Decision, changed: bool,
                before: int) -> None:
        """The series (each change, and every ``KEEP_ALIVE_S``), a log line per change:
        the target decided before and now, and Serve's (which follows)."""
        if changed:
            logger.info("dsv4: autoscale %s/%s: %d -> %d replicas (%s; Serve's target %d, "
                        "capacity %d undrained of %d running, KV usage %.2f, waiting %.1f per "
                        "replica)", ctx.app_name, ctx.deployment_name, before, decision.target,
                        decision.reason, obs.target, decision.capacity, obs.running,
                        decision.kv_usage, decision.waiting_per_replica)
        try:
            metrics = self._series()
        except Exception:  # a metrics failure must not stop scaling; logged each time
            logger.exception("dsv4: autoscale series could not be created")
            return
        tags = {"application": ctx.app_name or "", "llm_deployment": ctx.deployment_name}
        metrics["target"].set(decision.target, tags=tags)
        metrics["capacity"].set(decision.capacity, tags=tags)
        metrics["kv"].set(decision.kv_usage, tags=tags)
        metrics["waiting"].set(decision.waiting_per_replica, tags=tags)
        for reason in REASONS:
            metrics["reason"].set(float(reason == decision.reason), tags=tags | {"reason": reason})
        if decision.target != before:
            direction = "up" if decision.target > before else "down"
            metrics["changes"].inc(1, tags=tags | {"direction": direction,
                                                   "reason": decision.reason})

    def _series(self) -> dict[str, Any]:
        if self._metrics is None:  # in Serve's controller, not where the policy is pickled
            self._metrics = {key: series.make(s, serve_tags=False) for key, s in (
                ("target", series.SCALE_TARGET), ("capacity", series.SCALE_CAPACITY),
                ("kv", series.SCALE_KV), ("waiting", series.SCALE_WAITING),
                ("reason", series.SCALE_REASON), ("changes", series.SCALE_CHANGES))}
        return self._metrics


def serve_requests(ctx: Any) -> float | None:
    """Serve's count of the deployment's requests (its replicas' and its handles' queues,
    averaged over ``look_back_period_s``), or None where the context has none."""
    value = getattr(ctx, "total_num_requests", None)
    return float(value) if isinstance(value, int | float) else None


def with_autoscaling_policy(deployment_config: dict[str, Any], section: AutoscalingSection,
                            gang_size: int) -> dict[str, Any]:
    """``deployment_config`` with the ``kv_pressure`` policy in its autoscaling config,
    when it autoscales and ``dsv4.autoscaling.policy`` says so; a policy the user set
    there is an error (one of the two would be ignored). The user's
    ``target_ongoing_requests`` goes to the policy too (a third pressure), so it is not
    a setting accepted and ignored."""
    scaling = deployment_config.get("autoscaling_config")
    if scaling is None or section.policy != "kv_pressure":
        return deployment_config
    if scaling.get("policy") is not None:
        raise ValueError(
            "llm.deployment_config.autoscaling_config.policy is set and dsv4.autoscaling."
            "policy=kv_pressure: expected one policy. Fix: remove autoscaling_config.policy, "
            "or set dsv4.autoscaling.policy: serve_default to keep yours.")
    policy = {"policy_function": POLICY_FUNCTION,
              "policy_kwargs": section.policy_kwargs(gang_size) | serve_delays(scaling, section)
              | {"target_ongoing_requests": scaling.get("target_ongoing_requests")}}
    # Ray applies Serve's delays to a custom policy's answer too (ray#58857: serve.
    # autoscaling_policy._apply_autoscaling_config; 30 s up, 600 s down unless set): the
    # policy keeps them itself, so Serve's are 0, or every change waits twice.
    return deployment_config | {"autoscaling_config": dict(scaling) | {
        "policy": policy, "upscale_delay_s": 0.0, "downscale_delay_s": 0.0}}


SERVE_DELAYS = ("upscale_delay_s", "downscale_delay_s")


def serve_delays(scaling: dict[str, Any], section: AutoscalingSection) -> dict[str, float]:
    """Serve's ``upscale_delay_s``/``downscale_delay_s``, when the user set them, are the
    delays the policy keeps (Serve's own are then 0: see ``with_autoscaling_policy``);
    the same delay set differently in ``dsv4.autoscaling`` is an error."""
    taken: dict[str, float] = {}
    for name in SERVE_DELAYS:
        if scaling.get(name) is None:
            continue
        value, ours = float(scaling[name]), getattr(section, name)
        if name in section.model_fields_set and value != ours:
            raise ValueError(
                f"llm.deployment_config.autoscaling_config.{name}={value:g} and "
                f"dsv4.autoscaling.{name}={ours:g}: expected one value. Fix: drop one of them.")
        taken[name] = value
    if taken:
        AutoscalingSection(**(section.model_dump() | taken))  # the policy's own bounds
        logger.info("dsv4: kv_pressure autoscaling keeps Serve's %s as its own delays (Serve's "
                    "set to 0: not applied twice)", ", ".join(f"{k}={v:g}" for k, v in
                                                             taken.items()))
    return taken
