"""The KV-spec wire up to the controller: worker spec -> replica spec, and the verdicts back.

The hops and rules are ``deployments.control.wire``'s (every model is re-exported
there, the one place to import them from): each hop dumps these models to plain JSON
and validates what it receives; unknown keys are ignored (version skew).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 2
# The routing-stats key a drained replica sets (``record_routing_stats``) and
# ``deployments.serving.router.KVSpecRouter`` reads.
DRAIN_STAT = "dsv4_kv_drain"
# Routing stat: HTTP requests this replica's edge holds now, through either door.
HTTP_IN_FLIGHT_STAT = "dsv4_http_in_flight"
# Routing stats for session affinity (serving.affinity): vLLM's last KV usage (0..1),
# and 1 while the replica's last engine health check failed.
KV_USAGE_STAT = "dsv4_kv_usage"
ENGINE_DEAD_STAT = "dsv4_engine_dead"


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
