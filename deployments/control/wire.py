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
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 2
# The routing-stats key a drained replica sets (``record_routing_stats``) and
# ``deployments.serving.router.KVSpecRouter`` reads.
DRAIN_STAT = "dsv4_kv_drain"
# Routing stat: HTTP requests this replica's edge holds now, through either door.
HTTP_IN_FLIGHT_STAT = "dsv4_http_in_flight"


class _Wire(BaseModel):
    """Tolerant of unknown keys (version skew), strict about the ones it types."""

    model_config = ConfigDict(extra="ignore")


class State(str, Enum):
    """The fleet verdict. Only ``agree`` means every RUNNING replica was checked and conforms."""

    NOT_CHECKED = "not_checked"  # no check has completed since the controller started
    AGREE = "agree"
    DISAGREE = "disagree"  # at least one replica is odd (named, with the layers)
    INCOMPLETE = "incomplete"  # nothing odd among those that answered, but some did not
    STALE = "stale"  # the last check is older than dsv4.stale_after_s: do not trust it


class ReplicaStatus(str, Enum):
    OK = "ok"
    ODD = "odd"
    NO_ANSWER = "no_answer"


class Action(str, Enum):
    """What a replica does about its own verdict (never more than its own policy allows)."""

    SERVE = "serve"  # conforming, or odd under warn: keeps taking requests
    DRAIN = "drain"  # stays up for inspection; the request router sends it nothing
    FAIL_HEALTH = "fail_health"  # enforce: fails its health check so Serve replaces it


# ------------------------------------------------------------------ worker -> replica


class LayerSpec(_Wire):
    """One KV cache spec of one layer, as ``dsv4_patch.worker_ext.spec_to_dict`` emits it."""

    layer: str
    spec_type: str
    cache_dtype_str: str | None = None
    page_size_bytes: int | None = None
    real_page_size_bytes: int | None = None
    block_size: int | None = None
    head_size: int | None = None
    num_kv_heads: int | None = None
    dtype: str | None = None
    alignment: int | None = None
    sliding_window: int | None = None
    compress_ratio: int | None = None


class WorkerSpec(_Wire):
    """One engine worker (a TP/PP rank): its KV specs and what the plugin did there."""

    rank: int
    pid: int | None = None
    node_id: str | None = Field(default=None, description="Ray node id, when the worker "
                                "is a Ray actor (Ray executor); None under multiprocessing")
    specs: list[LayerSpec] = Field(min_length=1)
    patch_record: dict[str, Any] | None = None


# ----------------------------------------------------------------- replica -> controller


class LayerEntry(_Wire):
    """One cache in a replica's per-layer fingerprint: layer name -> the fields compared."""

    layer: str
    index: int | None = Field(description="decoder layer index parsed from the name")
    role: str = Field(description="main | indexer | swa | compressor_state | "
                      "indexer_compressor_state | other")
    spec_type: str
    cache_dtype_str: str | None
    page_size_bytes: int | None
    block_size: int | None
    head_size: int | None
    compress_ratio: int | None


class Prediction(_Wire):
    """The KV spec the byte model (``dsv4_patch.rules``) predicts from a config.

    ``layers`` covers the compressed (main) and indexer caches of every layer;
    None with ``reason`` when no prediction is possible (unknown architecture).
    """

    source: str = Field(description="what was predicted from: model, overrides, vLLM")
    storage: str | None = None
    cache_dtype_str: str | None = None
    layers: list[LayerEntry] | None = None
    fingerprint: str | None = None
    reason: str | None = None
    node_type: str | None = Field(default=None, description="the node the prediction is "
                                  "for (DeepSeek-V4.1: its record depends on the GPU)")
    bytes_per_token: float | None = Field(default=None, description="KV bytes one more "
                                          "context token costs on one rank (pages padded)")
    numerics: str | None = Field(default=None, description="what the stored numbers are")


class WorkerRow(_Wire):
    rank: int
    pid: int | None = None
    node_id: str | None = None
    fingerprint: str
    patch_record: dict[str, Any] | None = None


class ReplicaVerdict(_Wire):
    """The controller's word to one replica, and what the replica made of it."""

    odd: bool = False
    reason: str | None = None
    action: Action = Action.SERVE
    policy: str | None = Field(default=None, description="the policy the action came from")
    attempts: int = Field(default=0, description="enforce replacements of this rank so far")
    checked_at: float | None = Field(default=None, description="the check that last changed "
                                     "it (an unchanged verdict is not re-sent)")


class VerdictMessage(_Wire):
    """controller -> every replica: the verdict of each replica that answered.

    A replica missing from ``replicas`` keeps its previous verdict (it did not
    answer this check). ``policy_override`` is an operator's ``set_policy``;
    otherwise each replica obeys its own configured policy.
    """

    schema_version: int = SCHEMA_VERSION
    checked_at: float
    policy_override: str | None = None
    replicas: dict[str, ReplicaVerdict] = Field(default_factory=dict)


class TransferSpec(_Wire):
    """What a KV transfer between a prefill and a decode replica depends on (P/D only).

    Reported by a replica of a P/D pool next to its KV spec; compared pair by pair by
    ``deployments.pd.compat``. The connector fields come from the engine workers' live
    connector (``dsv4_patch.worker_ext.DSv4WorkerExtension.dsv4_kv_transfer``), the
    model identity from the files the engine loads, not from their path.
    """

    pool: Literal["prefill", "decode"]
    model_hash: str | None = Field(default=None, description="sha256 over config.json and "
                                   "the tokenizer files, by content")
    model_files: list[str] = Field(default_factory=list, description="the files hashed")
    model_path: str | None = Field(default=None, description="the model path string "
                                   "(what NIXL's own compatibility hash covers)")
    connector: str | None = Field(default=None, description="the live connector's class")
    connector_version: int | None = None
    kv_role: str | None = None
    transfer_mode: str | None = Field(default=None, description="pull (READ) | push (WRITE)")
    backend_names: list[str] = Field(default_factory=list)
    kv_cache_layout: str | None = None
    kernel_block_size: int | None = None
    region_block_lens: list[int] = Field(default_factory=list, description="NIXL's "
                                         "per-region block lengths in bytes, per worker rank 0")
    nixl_compat_hash: str | None = Field(default=None, description="NIXL's own handshake hash")
    enforce_handshake_compat: bool = True
    reason: str | None = Field(default=None, description="why a field could not be read")


class ReplicaSpec(_Wire):
    """A replica's answer to ``kv_page_spec()``: who, where, what its workers store."""

    schema_version: int = SCHEMA_VERSION
    replica_id: str
    rank: int | None
    node_id: str | None = Field(description="Ray node id of the replica actor")
    worker_node_ids: list[str | None] = Field(default_factory=list)
    pid: int | None = None
    deployment_version: str | None = Field(default=None, description="Serve's code version")
    policy: str = Field(description="this replica's own dsv4.policy")
    expected_layout: str = Field(description="this replica's own dsv4.expected_layout")
    versions: dict[str, str | None] = Field(default_factory=dict)
    node: dict[str, Any] = Field(default_factory=dict)
    kv_cache_dtype_requested: str | None = None
    kv_cache_dtype_engine: str | None = None
    resolution_reason: str | None = None
    override: dict[str, Any] | None = Field(default=None, description="the replica_overrides "
                                            "entry this rank applies (a canary), or None")
    layers: list[LayerEntry]
    fingerprint: str = Field(description="sha256 over the per-layer mapping")
    cache_dtypes: list[str]
    page_sizes: list[int]
    block_sizes: list[int]
    workers: list[WorkerRow]
    ranks_disagreeing: list[int] = Field(default_factory=list, description="worker ranks "
                                         "whose spec of a shared layer differs")
    prediction: Prediction = Field(description="from the deployment's config (no override)")
    own_prediction: Prediction | None = Field(default=None, description="from this replica's "
                                              "config with its override, when it has one")
    verdict: ReplicaVerdict = Field(default_factory=ReplicaVerdict)
    transfer: TransferSpec | None = Field(default=None, description="P/D pools only")

    @property
    def is_canary(self) -> bool:
        return self.override is not None


class ReplicaSpecBrief(_Wire):
    """A replica's short answer to ``kv_page_spec(known=...)``: "still the spec you hold".

    A replica's KV spec cannot change without a new engine (a new replica), so
    once the controller holds a replica's validated ``ReplicaSpec`` it sends the
    fingerprint it holds and the replica answers with this instead of ~50 kB of
    layers: the periodic check then costs a few hundred bytes per replica. The
    verdict is echoed so the controller knows what the replica acts on.
    """

    schema_version: int = SCHEMA_VERSION
    brief: Literal[True] = True
    replica_id: str
    fingerprint: str = Field(description="the fingerprint the controller sent, unchanged")
    verdict: ReplicaVerdict = Field(default_factory=ReplicaVerdict)


def answer_kv_page_spec(spec: ReplicaSpec, known: dict[str, str] | None) -> dict[str, Any]:
    """What a replica returns from ``kv_page_spec``: brief if the controller holds its spec."""
    if known and known.get(spec.replica_id) == spec.fingerprint:
        return ReplicaSpecBrief(replica_id=spec.replica_id, fingerprint=spec.fingerprint,
                                verdict=spec.verdict).model_dump(mode="json")
    return spec.model_dump(mode="json")


# ------------------------------------------------------------------ the fleet report


class LayerDifference(_Wire):
    layer: str
    field: str
    value: Any
    reference: Any


class Problem(_Wire):
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
    message: str = ""
    checked_at: float | None = None


class PDRouteMessage(_Wire):
    """controller -> each decode replica: the prefill replicas it may hand requests to."""

    schema_version: int = SCHEMA_VERSION
    checked_at: float
    verdict: PDVerdict
    allowed: dict[str, list[str]] = Field(default_factory=dict)


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
    problems: list[Problem] = Field(default_factory=list)
    checked_at: float | None = None
    check_seconds: float | None = None
    check_cpu_seconds: float | None = Field(default=None, description="CPU seconds the "
                                            "controller process used during the check (all "
                                            "its threads): its own cost, apart from waiting")
    age_s: float | None = Field(default=None, description="seconds since checked_at")
    pd: PDReport | None = Field(default=None, description="P/D apps: the two pools and "
                                "the verdict on transfers between them")


def schema() -> dict[str, Any]:
    """The JSON schema of every message, as published in docs/kv-spec.schema.json."""
    defs: dict[str, Any] = {}
    for model in (WorkerSpec, ReplicaSpec, ReplicaSpecBrief, VerdictMessage, PDRouteMessage,
                  FleetReport):
        one = model.model_json_schema(ref_template="#/$defs/{model}")
        defs.update(one.pop("$defs", {}))
        defs[model.__name__] = one
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "dsv4-serve KV-spec wire format",
        "description": f"schema_version {SCHEMA_VERSION}; generated by "
                       "`python -m deployments.control.wire`. Messages: WorkerSpec (worker -> "
                       "replica), ReplicaSpec / ReplicaSpecBrief (replica -> controller), "
                       "VerdictMessage (controller -> replicas), FleetReport "
                       "(controller -> GET /v1/kv-spec -> dsv4-serve status).",
        "$defs": defs,
    }


def schema_json() -> str:
    return json.dumps(schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(schema_json())
