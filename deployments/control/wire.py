"""The typed wire format of the KV-spec check: worker spec -> replica spec -> fleet report.

Five hops carry it: a vLLM worker (``dsv4_patch.worker_ext``) -> its replica
(``deployments.serving.server``) -> the controller (``deployments.control.controller``) -> the
ingress (``GET /v1/kv-spec``) -> ``dsv4-serve status``. Each hop dumps these
models to plain JSON (``model_dump(mode="json")``; never vLLM or torch objects)
and validates what it receives, so a malformed answer is named where it arrives
instead of surfacing as a ``KeyError`` three hops later.

Unknown keys are ignored, not rejected: during a rolling upgrade an older
controller reads a newer replica's answer. ``SCHEMA_VERSION`` says which shape a
sender speaks; ``python -m deployments.control.wire`` prints the JSON schema published
as ``docs/kv-spec.schema.json`` (checked by the tests).

The models up to the controller (worker and replica specs, verdicts) live in
``deployments.control.replica_wire``; this module re-exports them (import from here) and
holds the fleet report, its P/D part and the KV capacity the controller is given.
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from typing import Any, Literal

from pydantic import Field

from deployments.control.canary_wire import CanaryMode, CanaryRequest, CanaryResult
from deployments.control.replica_wire import (
    DRAIN_STAT,
    ENGINE_DEAD_STAT,
    HTTP_IN_FLIGHT_STAT,
    KV_USAGE_STAT,
    SCHEMA_VERSION,
    Action,
    LayerEntry,
    LayerSpec,
    Prediction,
    ReplicaSpec,
    ReplicaSpecBrief,
    ReplicaStatus,
    ReplicaVerdict,
    State,
    TransferSpec,
    VerdictMessage,
    WorkerRow,
    WorkerSpec,
    _Wire,
    answer_kv_page_spec,
)

__all__ = [
    "DRAIN_STAT",
    "ENGINE_DEAD_STAT",
    "HTTP_IN_FLIGHT_STAT",
    "KV_USAGE_STAT",
    "SCHEMA_VERSION",
    "Action",
    "CanaryMode",
    "CanaryRequest",
    "CanaryResult",
    "Expected",
    "FleetFinding",
    "FleetReport",
    "KVCapacityPlan",
    "LayerDifference",
    "LayerEntry",
    "LayerSpec",
    "NodeGroup",
    "NodeKVCapacity",
    "PDDifference",
    "PDPool",
    "PDReport",
    "PDRouteAck",
    "PDRouteMessage",
    "PDVerdict",
    "Prediction",
    "ReplicaRow",
    "ReplicaSpec",
    "ReplicaSpecBrief",
    "ReplicaStatus",
    "ReplicaVerdict",
    "State",
    "TransferSpec",
    "VerdictMessage",
    "WorkerRow",
    "WorkerSpec",
    "answer_kv_page_spec",
    "schema",
    "schema_json",
]


# ------------------------------------------------------------------ the fleet report


class LayerDifference(_Wire):
    layer: str
    field: str
    value: Any
    reference: Any


class FleetFinding(_Wire):
    """One finding of the controller's check, about the fleet or one replica."""

    kind: str = Field(description="prediction | mismatch | expected | intra_replica | "
                      "no_answer | silent | no_replicas | status | enforce_exhausted")
    replica: str | None = None
    field: str | None = None
    layers: list[LayerDifference] = Field(default_factory=list)
    message: str


class ReplicaRow(_Wire):
    """The report's entry for one replica."""

    id: str
    pool: str | None = Field(default=None, description="P/D apps: prefill | decode")
    rank: int | None = None
    node_id: str | None = None
    worker_node_ids: list[str | None] = Field(default_factory=list)
    deployment_version: str | None = None
    cache_dtype: str | list[str] | None = None
    cache_dtypes: list[str] = Field(default_factory=list)
    block_sizes: list[int] = Field(default_factory=list)
    page_sizes: list[int] = Field(default_factory=list)
    fingerprint: str | None = None
    predicted_fingerprint: str | None = None
    kv_cache_dtype_requested: str | None = None
    kv_cache_dtype_engine: str | None = None
    versions: dict[str, str | None] = Field(default_factory=dict)
    override: dict[str, Any] | None = None
    policy: str | None = None
    status: ReplicaStatus
    reason: str | None = None
    action: Action = Action.SERVE
    attempts: int = 0
    node_type: str | None = Field(default=None, description="the replica's node type key "
                                  "(its kv_capacity row)")


class PDVerdict(str, Enum):
    """Whether prefill replicas may hand KV to decode replicas."""

    NOT_CHECKED = "not_checked"  # one pool has not answered yet: no transfers
    COMPATIBLE = "compatible"  # every prefill replica fits every decode replica
    PARTIAL = "partial"  # some pairs differ; every decode replica keeps a compatible prefill
    INCOMPATIBLE = "incompatible"  # some decode replica has no compatible prefill replica


class PDDifference(_Wire):
    """One field on which a prefill replica and a decode replica differ."""

    field: str
    prefill_replica: str
    decode_replica: str
    prefill: Any
    decode: Any
    layers: list[LayerDifference] = Field(default_factory=list)


class PDPool(_Wire):
    deployment: str
    state: State
    replicas: list[str] = Field(default_factory=list)


class PDReport(_Wire):
    """The P/D verdict: which prefill replicas each decode replica may take KV from."""

    verdict: PDVerdict
    pools: dict[str, PDPool] = Field(default_factory=dict)
    allowed: dict[str, list[str]] = Field(default_factory=dict, description="decode "
                                          "replica -> prefill replicas it may route to")
    blocked_prefill: list[str] = Field(default_factory=list, description="prefill replicas "
                                       "no decode replica routes to")
    differences: list[PDDifference] = Field(default_factory=list)
    canaries: list[CanaryResult] = Field(default_factory=list, description="the latest "
                                         "output canary of each (decode, prefill) pair")
    canary_totals: dict[str, int] = Field(default_factory=dict, description="canaries run "
                                          "and failed, and pairs failed by their decode "
                                          "replica's failure counter (failed_by_counter), "
                                          "since the controller started")
    failed_kv_transfers: dict[str, int] = Field(default_factory=dict, description="decode "
                                                "replica -> KV transfers its engine counted "
                                                "as failed since it started (vLLM's "
                                                "vllm:nixl_num_failed_transfers), as of the "
                                                "last check")
    message: str = ""
    checked_at: float | None = None


class PDRouteMessage(_Wire):
    """controller -> each decode replica: the prefill replicas it may hand requests to."""

    schema_version: int = SCHEMA_VERSION
    checked_at: float
    verdict: PDVerdict
    allowed: dict[str, list[str]] = Field(default_factory=dict)


class PDRouteAck(_Wire):
    """each decode replica -> controller: the whitelist it took, and its failed transfers."""

    schema_version: int = SCHEMA_VERSION
    replica_id: str
    allowed: list[str] | None = Field(default=None, description="the prefill replicas it "
                                      "now routes to (None: no check yet)")
    failed_kv_transfers: int | None = Field(default=None, description="KV transfers the "
                                            "replica's engine counted as failed since it "
                                            "started (vLLM's vllm:nixl_num_failed_transfers: "
                                            "READs, handshakes, notifications); None: not "
                                            "read, see failed_kv_transfers_unread")
    failed_kv_transfers_unread: str | None = Field(default=None, description="why the "
                                                   "count is not read")


class NodeGroup(_Wire):
    """Replicas on one node type that conform to that node's own prediction.

    A fleet mixing GPU generations (H200 + B200 serving DeepSeek-V4.1) is several
    conforming groups, not an odd half: each group is named with what differs.
    """

    node_type: str
    replicas: list[str]
    fingerprint: str | None = None
    cache_dtype_str: str | None = None
    bytes_per_token: float | None = None
    tokens_per_gib: int | None = Field(default=None, description="KV capacity per GiB of "
                                       "cache memory, from bytes_per_token")
    numerics: str | None = None


class Expected(_Wire):
    layout: str
    fingerprint: str | None = None
    reference: Literal["prediction", "majority", "none"] = Field(
        description="prediction: judged against the byte model; majority: no prediction "
        "was possible, so the most common fingerprint (ties against canaries)")
    note: str | None = None
    node_groups: list[NodeGroup] = Field(default_factory=list, description="conforming "
                                         "groups when replicas on different node types "
                                         "were each judged against their own node")


class NodeKVCapacity(_Wire):
    """One node type's KV figures, as ``dsv4-serve plan`` computes them (``plan.kv_figures``)."""

    node_type: str = Field(description="the expected_layouts key: cpu, sm90, sm100...")
    storage: str
    block_size: int = Field(description="the block size plan sized with (vLLM's "
                            "cache_config_info says the minimum over groups, vllm#51163)")
    kv_bytes_per_token: float = Field(description="fullest pipeline stage, one GPU")
    kv_budget_bytes: float | None = None
    kv_tokens_per_engine: int | None = None
    kv_tokens_per_replica: int | None = None


class KVCapacityPlan(_Wire):
    """The controller's KV capacity per node type, or why it has none."""

    nodes: list[NodeKVCapacity] = Field(default_factory=list)
    reason: str | None = Field(default=None, description="why no figures (no config.json)")

    def for_node(self, node_type: str) -> NodeKVCapacity | None:
        return next((n for n in self.nodes if n.node_type == node_type), None)


class FleetReport(_Wire):
    """``GET /v1/kv-spec``: the verdict over every RUNNING replica of one deployment."""

    schema_version: int = SCHEMA_VERSION
    state: State
    agree: bool
    previous_state: State | None = Field(default=None, description="when stale: the "
                                         "state of the last completed check")
    policy: str
    policy_override: str | None = None
    deployment: str | None = None
    application: str | None = None
    expected: Expected
    running_replicas: int | None = None
    answered: int = 0
    replicas: list[ReplicaRow] = Field(default_factory=list)
    odd_replicas: dict[str, str] = Field(default_factory=dict)
    problems: list[FleetFinding] = Field(default_factory=list)
    checked_at: float | None = None
    check_seconds: float | None = None
    check_cpu_seconds: float | None = Field(default=None, description="CPU seconds the "
                                            "controller process used during the check (all "
                                            "its threads): its own cost, apart from waiting")
    age_s: float | None = Field(default=None, description="seconds since checked_at")
    pd: PDReport | None = Field(default=None, description="P/D apps: the two pools and "
                                "the verdict on transfers between them")
    kv_capacity: KVCapacityPlan | None = Field(default=None, description="KV capacity "
                                               "per node type, as dsv4-serve plan has it")


def schema() -> dict[str, Any]:
    """The JSON schema of every message, as published in docs/kv-spec.schema.json."""
    defs: dict[str, Any] = {}
    for model in (WorkerSpec, ReplicaSpec, ReplicaSpecBrief, VerdictMessage, PDRouteMessage,
                  PDRouteAck, FleetReport):
        one = model.model_json_schema(ref_template="#/$defs/{model}")
        defs.update(one.pop("$defs", {}))
        defs[model.__name__] = one
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "dsv4-serve KV-spec wire format",
        "description": f"schema_version {SCHEMA_VERSION}; generated by "
                       "`python -m deployments.control.wire`. Messages: WorkerSpec (worker -> "
                       "replica), ReplicaSpec / ReplicaSpecBrief (replica -> controller), "
                       "VerdictMessage (controller -> replicas), PDRouteMessage / PDRouteAck "
                       "(P/D controller <-> decode replicas), FleetReport "
                       "(controller -> GET /v1/kv-spec -> dsv4-serve status).",
        "$defs": defs,
    }


def schema_json() -> str:
    return json.dumps(schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(schema_json())
