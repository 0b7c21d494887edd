"""The catalogue of every Prometheus series dsv4-serve defines, and how Ray exports them.

One list, read by the code that creates the series (``make``) and by the dashboard's
test: a panel on a name that is not here (or not vLLM's) fails before anyone deploys it.

Names follow Prometheus' conventions (base units in the name: ``_seconds``, ``_bytes``;
counters end in ``_total``; ``*_info`` gauges are 1 and carry labels to join on) and
vLLM's where the two overlap (``time_to_first_token_seconds``, ``requests_in_flight``).
Ray's metrics agent exports every ``ray.util.metrics`` series prefixed ``ray_`` with
``:`` turned into ``_`` (``exported``): vLLM's ``vllm:kv_cache_usage_perc`` becomes
``ray_vllm_kv_cache_usage_perc``, tagged ``ReplicaId``; ours are tagged ``replica``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any


class Kind(str, Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


# Seconds: from a loopback edge check (~0.1 ms) to a slow prefill on 2 CPU cores.
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0, 10.0, 30.0, 60.0)

# The per-replica labels. ``replica`` is Serve's replica id (``ReplicaID.unique_id``),
# the value Serve puts in its own ``replica`` tag and vLLM in ``ReplicaId``;
# ``application`` is Serve's app name: two apps of one config share a deployment name.
KV_TAGS = ("application", "llm_deployment", "replica", "node_type")
FLEET_TAGS = ("llm_deployment",)


@dataclass(frozen=True)
class Series:
    """One series: what ``ray.util.metrics`` is given, and where it is created."""

    name: str
    kind: Kind
    help: str
    tags: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    # controller | pd_controller | replica (the serving replica's process) |
    # serve_controller (Serve's own controller, where an autoscaling policy runs) | ray_serve
    where: str = "controller"

    def exported(self) -> tuple[str, ...]:
        """The sample names Prometheus scrapes from Ray's metrics agent."""
        return exported(self.name, self.kind)


def exported(name: str, kind: Kind) -> tuple[str, ...]:
    """Sample names of one series after Ray's export (prefix, ``:`` -> ``_``, suffixes)."""
    base = "ray_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)
    if kind is Kind.HISTOGRAM:
        return (f"{base}_bucket", f"{base}_sum", f"{base}_count")
    if kind is Kind.COUNTER:
        return (base if base.endswith("_total") else f"{base}_total",)
    return (base,)


def _g(name: str, help: str, tags: tuple[str, ...]) -> Series:
    return Series(name, Kind.GAUGE, help, tags)


def _gauges(tags: tuple[str, ...], where: str, *rows: tuple[str, str]) -> tuple[Series, ...]:
    """Gauges that share their tags and their process: one ``(name, help)`` row each."""
    return tuple(Series(name, Kind.GAUGE, help, tags, where=where) for name, help in rows)


# ----------------------------------------------------------- the controller: the fleet
AGREE, RUNNING, ANSWERED, ODD, DRAINED, STALE, AGE = _gauges(
    FLEET_TAGS, "controller",
    ("dsv4_kv_spec_agree", "1 if every RUNNING replica has the predicted KV spec (fresh "
     "report), else 0"),
    ("dsv4_kv_spec_running_replicas", "RUNNING replicas per Serve"),
    ("dsv4_kv_spec_answered_replicas", "replicas that answered kv_page_spec in the last "
     "check"),
    ("dsv4_kv_spec_odd_replicas", "replicas whose KV spec differs from the prediction, "
     "their peers or the expected layout"),
    ("dsv4_kv_spec_drained_replicas", "odd replicas kept up but routed no requests (policy "
     "drain, or enforce gave up)"),
    ("dsv4_kv_spec_stale", "1 if the last completed check is older than dsv4.stale_bound_s"),
    ("dsv4_kv_spec_report_age_seconds", "seconds since the last completed check"))
CHECKS = Series("dsv4_kv_spec_checks_total", Kind.COUNTER, "KV-spec checks run",
                (*FLEET_TAGS, "state"))
REPLACEMENTS = Series("dsv4_kv_spec_enforce_replacements_total", Kind.COUNTER,
                      "odd replicas told to fail health under enforce", FLEET_TAGS)

# ------------------------------------------------------- the controller: each replica
REPLICA_INFO = _g("dsv4_kv_replica_info", "1 per answering replica; its labels say what it "
                  "stores (status ok|odd, action serve|drain|fail_health, cache dtype, "
                  "fingerprints): join other series on replica to get node_type",
                  (*KV_TAGS, "status", "action", "cache_dtype", "fingerprint",
                   "predicted_fingerprint"))
AS_PREDICTED = _g("dsv4_kv_layout_as_predicted", "1 if the replica's reported per-layer KV "
                  "layout equals the byte model's prediction for its node, else 0", KV_TAGS)
PAGE_BYTES = _g("dsv4_kv_page_bytes", "bytes of one KV page of a cache group "
                "(role/compress ratio; source reported by the engine or predicted by the "
                "byte model). vLLM's cache_config_info block_size is the minimum over "
                "DeepSeek-V4's groups (vllm#51163): these are the real pages",
                (*KV_TAGS, "cache_group", "source"))
BYTES_PER_TOKEN = _g("dsv4_kv_bytes_per_token", "KV bytes one more context token costs on "
                     "one GPU of the replica (fullest pipeline stage, pages padded), as "
                     "dsv4-serve plan computes it for the replica's node type", KV_TAGS)
CAPACITY_TOKENS = _g("dsv4_kv_capacity_tokens", "context tokens of KV cache the replica "
                     "holds (all its DP engines), as dsv4-serve plan computes it for its "
                     "node type", KV_TAGS)
ENGINE_CAPACITY_TOKENS = _g("dsv4_kv_capacity_tokens_per_engine", "context tokens of KV "
                            "cache one engine of the replica holds (dsv4-serve plan)", KV_TAGS)
BUDGET_BYTES = _g("dsv4_kv_budget_bytes", "bytes one GPU (or the CPU KV space) of the "
                  "replica has for KV pages after the weights (dsv4-serve plan)", KV_TAGS)

# ------------------------------------------- the serving replica: its own path's time
STAGE = Series("dsv4_serve_request_stage_seconds", Kind.HISTOGRAM,
               "time a request spends in one stage of the serving path on the replica: "
               "edge (keys, route, body, bounds until vLLM's app has it), "
               "engine_first_token (vLLM's app and engine until the first response "
               "chunk), edge_stream (the edge's work on the later chunks, summed)",
               ("stage",), STAGE_BUCKETS, "replica")
TTFT = Series("dsv4_serve_time_to_first_token_seconds", Kind.HISTOGRAM,
              "arrival at the replica to its first response chunk (edge + "
              "engine_first_token): the TTFT the serving path delivers",
              (), STAGE_BUCKETS, "replica")
# Ray's export approximates a histogram's _sum from bucket midpoints (its OpenTelemetry
# recorder): the exact seconds, which the split is checked with, are these counters.
STAGE_TOTAL = Series("dsv4_serve_request_stage_seconds_total", Kind.COUNTER,
                     "exact seconds spent per stage (the histogram's _sum is Ray's "
                     "bucket-midpoint estimate)", ("stage",), (), "replica")
TTFT_TOTAL = Series("dsv4_serve_time_to_first_token_seconds_total", Kind.COUNTER,
                    "exact seconds of delivered TTFT, summed over requests", (), (),
                    "replica")
IN_FLIGHT = Series("dsv4_serve_requests_in_flight", Kind.GAUGE, "HTTP requests the "
                   "replica's serving path holds now (edge to last byte)", (), (), "replica")
REFUSED = Series("dsv4_serve_requests_refused_total", Kind.COUNTER, "requests the edge "
                 "answered itself with an error, by reason (keys, routes, bounds, "
                 "body_deadline, overload, drain, stream_limit...)", ("reason",), (), "replica")

# ------------------------------------------ the serving replica: its API key file
KEY_FILE_STALE = Series("dsv4_api_key_file_stale", Kind.GAUGE, "1 while an edit of the API "
                        "key file is refused and the last good keys still serve", (), (),
                        "replica")
KEY_FILE_KEYS = Series("dsv4_api_key_file_keys", Kind.GAUGE, "keys from the API key file in "
                       "use (0 with a missing or empty file: requests fail closed)", (), (),
                       "replica")
KEY_FILE_REFUSED = Series("dsv4_api_key_file_refused_edits_total", Kind.COUNTER, "API key "
                          "file edits refused (short key, not UTF-8, unreadable)", (), (),
                          "replica")

# --------------------------------------- the serving replica: the Responses store
RESPONSES_RECORDS = Series("dsv4_responses_store_records", Kind.GAUGE, "Responses records "
                           "in the shared store", (), (), "replica")
RESPONSES_ERRORS = Series("dsv4_responses_store_errors_total", Kind.COUNTER, "Responses "
                          "store calls that failed or timed out (the request got a 503)",
                          ("op",), (), "replica")

# --------------------------------------------- the P/D controller: one P/D app
PD_TAGS = ("pd_application",)
PD_COMPATIBLE, PD_VERDICT, PD_PAIRS, PD_BLOCKED, PD_STRANDED = _gauges(
    PD_TAGS, "pd_controller",
    ("dsv4_pd_compatible", "1 if every prefill replica is KV-compatible with every decode "
     "replica"),
    ("dsv4_pd_verdict", "0 not_checked, 1 compatible, 2 partial, 3 incompatible"),
    ("dsv4_pd_allowed_pairs", "(decode, prefill) replica pairs allowed to transfer KV"),
    ("dsv4_pd_blocked_prefill_replicas", "prefill replicas no decode replica routes to"),
    ("dsv4_pd_stranded_decode_replicas", "decode replicas with no compatible prefill replica "
     "(they prefill locally)"))

# ---------------------------------- Serve's controller: the kv_pressure autoscaling policy
# Set by deployments.serving.autoscale at each decision that differs from the last.
SCALE_TAGS = ("application", "llm_deployment")
SCALE_TARGET = Series("dsv4_autoscale_target_replicas", Kind.GAUGE, "replicas the "
                      "kv_pressure policy asks Serve for (drained ones included)",
                      SCALE_TAGS, where="serve_controller")
SCALE_CAPACITY = Series("dsv4_autoscale_capacity_replicas", Kind.GAUGE, "replicas the "
                        "policy counts as capacity: running and not drained",
                        SCALE_TAGS, where="serve_controller")
SCALE_KV = Series("dsv4_autoscale_kv_usage", Kind.GAUGE, "mean KV cache usage (0..1) of "
                  "the undrained replicas, as the policy last saw it", SCALE_TAGS,
                  where="serve_controller")
SCALE_WAITING = Series("dsv4_autoscale_waiting_per_replica", Kind.GAUGE, "requests "
                       "waiting in vLLM per undrained replica, as the policy last saw it",
                       SCALE_TAGS, where="serve_controller")
SCALE_REASON = Series("dsv4_autoscale_decision", Kind.GAUGE, "1 for the reason of the "
                      "policy's current decision (kv_pressure, queue_pressure, "
                      "ongoing_requests, quiet, hold, no_metrics, bounds), 0 for the others",
                      (*SCALE_TAGS, "reason"), where="serve_controller")
SCALE_CHANGES = Series("dsv4_autoscale_changes_total", Kind.COUNTER, "target changes the "
                       "policy decided, by direction (up|down) and reason",
                       (*SCALE_TAGS, "direction", "reason"), where="serve_controller")
AUTOSCALE_SERIES = (SCALE_TARGET, SCALE_CAPACITY, SCALE_KV, SCALE_WAITING, SCALE_REASON,
                    SCALE_CHANGES)

CONTROLLER_SERIES = (AGREE, RUNNING, ANSWERED, ODD, DRAINED, STALE, AGE, CHECKS,
                     REPLACEMENTS, REPLICA_INFO, AS_PREDICTED, PAGE_BYTES, BYTES_PER_TOKEN,
                     CAPACITY_TOKENS, ENGINE_CAPACITY_TOKENS, BUDGET_BYTES)
REPLICA_SERIES = (STAGE, TTFT, STAGE_TOTAL, TTFT_TOTAL, IN_FLIGHT, REFUSED, KEY_FILE_STALE,
                  KEY_FILE_KEYS, KEY_FILE_REFUSED, RESPONSES_RECORDS, RESPONSES_ERRORS)

# ------------------------------------------------ the P/D controller: the output canary
PD_CANARY_FAILED = Series("dsv4_pd_canary_failed_pairs", Kind.GAUGE, "(decode, prefill) "
                          "replica pairs whose latest output canary failed: excluded from "
                          "routing until a clean one (deployments.pd.canary)", PD_TAGS,
                          where="pd_controller")
PD_CANARY_PASSED = Series("dsv4_pd_canary_passed_pairs", Kind.GAUGE, "(decode, prefill) "
                          "replica pairs whose latest output canary passed", PD_TAGS,
                          where="pd_controller")
PD_CANARY_MAX_DELTA = Series("dsv4_pd_canary_max_logprob_delta", Kind.GAUGE, "largest "
                             "per-token logprob difference (nats) of the latest canaries, "
                             "through the pair vs scored on the decode replica alone",
                             PD_TAGS, where="pd_controller")
PD_FAILED_TRANSFERS = Series("dsv4_pd_failed_kv_transfers", Kind.GAUGE, "KV transfers a "
                             "decode replica's engine counted as failed since it started "
                             "(vLLM's vllm:nixl_num_failed_transfers, as the replica last "
                             "reported it); a rise excludes all its pairs until a clean canary",
                             (*PD_TAGS, "decode_replica"), where="pd_controller")
PD_SERIES = (PD_COMPATIBLE, PD_VERDICT, PD_PAIRS, PD_BLOCKED, PD_STRANDED, PD_CANARY_FAILED,
             PD_CANARY_PASSED, PD_CANARY_MAX_DELTA, PD_FAILED_TRANSFERS)

ALL = CONTROLLER_SERIES + REPLICA_SERIES + PD_SERIES + AUTOSCALE_SERIES

# Ray Serve's own series the dashboard reads (Serve creates them; ``make`` never does).
# The queueing/routing stage: how long a request waited in a Serve router (Serve's proxy
# on 8000/8500, or a DeploymentHandle) before a replica was picked, per deployment.
# Ray 2.60: ray/serve/_private/request_router/request_router.py
# (``queue_wait_time_ms_histogram``, observed in ``_record_queue_wait_time``). Serve's
# name, so milliseconds; a replica's own port has no router, so no sample there.
ROUTER_QUEUE_WAIT = Series("serve_request_router_fulfillment_time_ms", Kind.HISTOGRAM,
                           "ms a request waited in a Serve router before a replica was "
                           "assigned", ("deployment", "application", "actor_id",
                                        "handle_source"), where="ray_serve")
SERVE_SERIES = (ROUTER_QUEUE_WAIT,)


def exported_names() -> set[str]:
    """Every sample name of the series above (ours and Serve's the dashboard reads), as
    scraped from Ray's metrics agent."""
    return {name for s in ALL + SERVE_SERIES for name in s.exported()}


def make(series: Series, serve_tags: bool = True) -> Any:
    """The Ray metric for ``series``.

    ``serve_tags``: through ``ray.serve.metrics``, which adds Serve's ``deployment``,
    ``replica`` and ``application`` tags of the process that records; without, through
    ``ray.util.metrics`` with ``series.tags`` only (the controller's per-replica
    series name the *served* replica in ``replica``, which Serve reserves).
    """
    if serve_tags:
        from ray.serve import metrics
    else:
        from ray.util import metrics
    tags = series.tags or None
    if series.kind is Kind.HISTOGRAM:
        return metrics.Histogram(series.name, series.help, boundaries=list(series.buckets),
                                 tag_keys=tags)
    cls = metrics.Counter if series.kind is Kind.COUNTER else metrics.Gauge
    return cls(series.name, series.help, tag_keys=tags)


def make_each(*each: Series, serve_tags: bool = True) -> tuple[Any, ...]:
    """The Ray metrics for ``each``, in order: a process's set of series in one call."""
    return tuple(make(s, serve_tags) for s in each)
