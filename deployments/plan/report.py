"""What ``dsv4-serve plan`` reports: one plan per application, per node type, per config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from deployments.config.checks import Finding
from deployments.plan.capacity import Capacity
from dsv4_patch import rules


@dataclass
class NodeCapacity:
    """One node type of an application: what its replicas store and hold.

    A mixed fleet (``dsv4.node_types``) has one per GPU type; DeepSeek-V4.1 writes
    other bytes on each (``rules.v41_record``), so capacity is per type, not per app.
    """

    node_type: str  # the expected_layouts key: sm90, sm100, ...
    node: dict[str, Any]
    layout: str  # fp8_ds_mla | nvfp4_ds_mla | plain_rows
    expected_layout: str
    backend: str
    cache_dtype_str: str
    block_size: int
    numerics: str
    capacity: Capacity


@dataclass
class ReplicaPlan:
    """Everything ``plan`` knows about one application's replicas."""

    application: str
    model: str
    node: dict[str, Any]
    parallel: dict[str, Any]
    vllm_version: str
    layout: str
    backend: str
    layout_reason: str
    expected_layout: str
    kv_cache_dtype: str
    engine_kv_cache_dtype: str
    cache_dtype_str: str
    resolution_reason: str
    block_size: int
    max_model_len: int | None
    weights_total_bytes: float
    parameters: int
    capacity: Capacity
    fp8_ds_mla_capacity: Capacity | None = None  # the counterfactual, when rows
    # DP presets: the same GPUs as one tensor-parallel engine (KV replicated per rank)
    tp_alternative: Capacity | None = None
    pd: dict[str, Any] | None = None  # P/D apps: deployments.plan.pd.summary
    family: str = rules.Family.V4.value
    # Every node type's capacity (one entry unless dsv4.node_types lists several).
    node_capacities: list[NodeCapacity] = field(default_factory=list)
    mix: dict[str, Any] | None = None  # several node types: ratios between them
    problems: list[Finding] = field(default_factory=list)

    @property
    def refused(self) -> bool:
        return any(p.severity == "error" for p in self.problems)


@dataclass
class PlanReport:
    config: str
    applications: list[ReplicaPlan]
    problems: list[Finding]

    @property
    def refused(self) -> bool:
        return any(p.severity == "error" for p in self.problems) or any(
            a.refused for a in self.applications)

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "refused": self.refused,
                "applications": [asdict(a) | {"refused": a.refused} for a in self.applications],
                "problems": [asdict(p) for p in self.problems]}


def capability_text(node: Mapping[str, Any]) -> str:
    """``sm 9.0`` for a node dict with a compute capability, else empty."""
    cap = node.get("compute_capability")
    return f"sm {cap[0]}.{cap[1]}" if cap else ""
