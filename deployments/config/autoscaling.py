"""``args.dsv4.autoscaling``: when the server deployment scales, on what the engine knows.

Serve's default policy scales on ongoing requests per replica; an LLM replica's limit is
its KV cache, and requests queue in vLLM's scheduler when the KV cache is full, not when
a request count is reached. ``kv_pressure`` (``deployments.serving.autoscale``) scales
on each replica's KV usage and waiting requests, counts only replicas the KV-spec check
has not drained, and steps down one replica at a time after a quiet period.

Defaults, from the published anchors: llm-d's variant autoscaler adds a replica at KV
usage >= 0.80 or a queue >= 5 (its saturation thresholds); Dynamo's planner scales on KV
utilisation and prefill queue the same way. 0.80 leaves a fifth of the cache for the
running requests' next tokens while the new replica boots (~1-2 min for a GPU node's
weights), so requests start to wait only if load keeps growing through the boot. Down:
only when the KV in use would fit the replicas left under ``kv_usage_down`` (0.50:
below 0.80 by a margin, so removing one never lands in scale-up territory: no
up/down cycle) with nothing waiting, for ``downscale_delay_s`` (300 s, Serve's
downscale delay is 600 s; a replica here costs a GPU node).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from deployments.config.base import _Strict

POLICY_FUNCTION = "deployments.serving.autoscale:KVPressurePolicy"


class AutoscalingSection(_Strict):
    """The knobs of the ``kv_pressure`` policy (used when the deployment autoscales)."""

    policy: Literal["kv_pressure", "serve_default"] = Field(
        default="kv_pressure", description="kv_pressure: scale on KV usage and waiting "
        "requests (ours); serve_default: Serve's ongoing-requests policy")
    kv_usage_up: float = Field(default=0.80, gt=0, le=1, description="add replicas when "
                               "the undrained replicas' mean KV usage reaches this")
    waiting_up: float = Field(default=5.0, gt=0, description="add replicas when the "
                              "requests waiting in vLLM per undrained replica reach this")
    kv_usage_down: float = Field(default=0.50, gt=0, lt=1, description="remove one "
                                 "replica when the KV in use would fit the rest under this")
    upscale_delay_s: float = Field(default=0.0, ge=0, le=3600, description="pressure must "
                                   "last this long before replicas are added")
    downscale_delay_s: float = Field(default=300.0, ge=0, le=86400, description="quiet must "
                                     "last this long (and as long since the last change) "
                                     "before one replica is removed")
    max_step_up: int = Field(default=4, ge=1, le=64, description="replicas added at most "
                             "per decision")

    @model_validator(mode="after")
    def _hysteresis(self) -> AutoscalingSection:
        if self.kv_usage_down >= self.kv_usage_up:
            raise ValueError(
                f"dsv4.autoscaling.kv_usage_down={self.kv_usage_down} >= kv_usage_up="
                f"{self.kv_usage_up}: expected down < up, or a replica removed lands in "
                "scale-up territory and the fleet flaps. Fix: lower kv_usage_down.")
        return self

    def policy_kwargs(self, gang_size: int) -> dict[str, float | int]:
        """What Serve's controller constructs ``KVPressurePolicy`` with (plain JSON)."""
        return self.model_dump(exclude={"policy"}) | {"gang_size": gang_size}
