"""KV-spec fingerprints and the fleet verdict: pure functions, no Ray, no vLLM.

The replica summarizes what its workers report (``dsv4_patch.worker_ext``) and
the controller compares replicas. Both halves live here so they can be tested
on recorded data in milliseconds and so the replica and the controller can
never disagree about what "the same KV spec" means.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# What makes two KV caches interchangeable: a request's pages could move between
# them (P/D transfer, migration) and capacity planning holds for both.
FINGERPRINT_FIELDS = (
    "spec_type",
    "cache_dtype_str",
    "page_size_bytes",
    "block_size",
    "head_size",
    "compress_ratio",
)

# Replica summary fields compared to name what differs, most telling first: the
# stored format, then the bytes per page (what capacity and transfers depend on),
# then the per-spec block sizes (tokens, or compressed states, per block).
COMPARED_FIELDS = ("cache_dtypes", "page_sizes", "block_sizes", "layer_groups")

AGREE, DISAGREE, INCOMPLETE = "agree", "disagree", "incomplete"


class WorkerSpecError(ValueError):
    """A worker's answer to ``dsv4_kv_specs`` is not what the extension returns."""


def layer_groups(specs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Collapse per-layer specs into groups of identical fingerprint fields + a layer count."""
    counts: Counter[tuple[Any, ...]] = Counter(
        tuple(spec.get(f) for f in FINGERPRINT_FIELDS) for spec in specs
    )
    groups = [
        dict(zip(FINGERPRINT_FIELDS, key, strict=True)) | {"layers": n}
        for key, n in counts.items()
    ]
    return sorted(groups, key=lambda g: json.dumps(g, sort_keys=True, default=str))


def fingerprint(groups: Sequence[Mapping[str, Any]]) -> str:
    """sha256 of the canonical JSON of the layer groups: equal iff the groups are equal."""
    canonical = json.dumps(list(groups), sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def summarize_workers(workers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One replica's KV spec from its workers' answers.

    Under tensor/pipeline parallelism every rank reports; ranks of one engine
    must agree (vLLM asserts it), but we check instead of assuming, because
    the whole point is not to trust that replicas are alike.
    """
    if not workers:
        raise WorkerSpecError("no worker answered dsv4_kv_specs; expected one dict per rank")
    per_rank = []
    for worker in workers:
        if not isinstance(worker, Mapping) or "specs" not in worker:
            raise WorkerSpecError(
                f"worker answer {str(worker)[:200]!r} has no 'specs'; expected the dict "
                "returned by dsv4_patch.worker_ext.DSv4WorkerExtension.dsv4_kv_specs"
            )
        per_rank.append(layer_groups(worker["specs"]))
    groups = per_rank[0]
    split = [w.get("rank") for w, g in zip(workers, per_rank, strict=True) if g != groups]
    return {
        "layer_groups": groups,
        "fingerprint": fingerprint(groups),
        "cache_dtypes": sorted(
            {str(g["cache_dtype_str"]) for g in groups if g["cache_dtype_str"] is not None}
        ),
        "block_sizes": sorted({g["block_size"] for g in groups if g["block_size"] is not None}),
        "page_sizes": sorted(
            {g["page_size_bytes"] for g in groups if g["page_size_bytes"] is not None}
        ),
        "ranks_disagreeing_with_rank0": split,
    }


def layout_problem(summary: Mapping[str, Any], expected_layout: str) -> str | None:
    """Why a replica's specs contradict the expected layout, or None.

    fp8_ds_mla: every attention group must store the packed record (the specs
    with a cache dtype; state-only specs carry None). plain_rows: none may.
    """
    dtypes = [str(g["cache_dtype_str"]) for g in summary["layer_groups"]
              if g.get("cache_dtype_str") is not None]
    if not dtypes:
        return "no layer reports a cache dtype; expected at least one attention layer"
    packed = [d == "fp8_ds_mla" for d in dtypes]
    if expected_layout == "fp8_ds_mla" and not all(packed):
        bad = sorted({d for d in dtypes if d != "fp8_ds_mla"})
        return f"cache_dtype: expected fp8_ds_mla on every attention layer, found {bad}"
    if expected_layout == "plain_rows" and any(packed):
        return "cache_dtype: expected plain rows, found fp8_ds_mla layers"
    return None


def _differences(spec: Mapping[str, Any], ref: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The compared fields where ``spec`` differs from ``ref``, with both values."""
    out = []
    for field in COMPARED_FIELDS:
        if spec.get(field) != ref.get(field):
            out.append({"field": field, "value": spec.get(field), "reference": ref.get(field)})
    return out


def _reference(specs: Sequence[Mapping[str, Any]]) -> str | None:
    """The fingerprint the fleet should have: the majority; ties go to the lowest rank.

    The lowest rank is the longest-lived replica of a deployment, so on a tie the
    newcomer (a canary, a replica on a new node type) is the one named odd.
    """
    if not specs:
        return None
    votes = Counter(s["fingerprint"] for s in specs)
    top = max(votes.values())
    tied = {fp for fp, n in votes.items() if n == top}
    ranked = sorted(specs, key=lambda s: (s.get("rank") is None, s.get("rank") or 0))
    return next(s["fingerprint"] for s in ranked if s["fingerprint"] in tied)


def replica_row(spec: Mapping[str, Any], odd: bool) -> dict[str, Any]:
    """The per-replica entry of the report: who, where, what it stores."""
    return {
        "id": spec["replica_id"],
        "rank": spec.get("rank"),
        "node_id": spec.get("node_id"),
        "cache_dtype": spec["cache_dtypes"][0] if len(spec["cache_dtypes"]) == 1
        else spec["cache_dtypes"],
        "cache_dtypes": spec["cache_dtypes"],
        "block_sizes": spec["block_sizes"],
        "page_sizes": spec["page_sizes"],
        "fingerprint": spec["fingerprint"],
        "kv_cache_dtype_requested": spec.get("kv_cache_dtype_requested"),
        "kv_cache_dtype_engine": spec.get("kv_cache_dtype_engine"),
        "versions": spec.get("versions"),
        "override": spec.get("override"),
        "status": "odd" if odd else "ok",
    }


def decide(
    specs: Sequence[Mapping[str, Any]],
    errors: Sequence[str],
    running: int | None,
    expected_layout: str,
) -> dict[str, Any]:
    """The verdict over the replicas that answered.

    ``disagree``: some replica's fingerprint differs from the reference, or its
    specs contradict the expected layout; each such replica is named with the
    differing fields. ``incomplete``: no disagreement among those that
    answered, but some RUNNING replica did not answer (or none is running).
    ``agree``: every RUNNING replica answered with the reference fingerprint.
    """
    problems: list[dict[str, Any]] = []
    odd: dict[str, str] = {}
    ref_fp = _reference(specs)
    ref = next((s for s in specs if s["fingerprint"] == ref_fp), None)
    for spec in specs:
        rid = spec["replica_id"]
        bad_layout = layout_problem(spec, expected_layout)
        if bad_layout:
            odd[rid] = bad_layout
            problems.append({"kind": "expected", "replica": rid, "field": "cache_dtype",
                             "message": f"replica {rid}: {bad_layout}"})
        if ref is not None and spec["fingerprint"] != ref_fp:
            diffs = _differences(spec, ref)
            text = "; ".join(f"{d['field']}={d['value']} vs {d['reference']}" for d in diffs)
            msg = (f"replica {rid} (rank {spec.get('rank')}) differs from the fleet "
                   f"(reference replica {ref['replica_id']}): {text or 'layer details'}")
            odd[rid] = odd.get(rid, msg) if bad_layout else msg
            problems.append({"kind": "mismatch", "replica": rid,
                             "field": diffs[0]["field"] if diffs else "layer_groups",
                             "differences": diffs, "message": msg})
        if spec.get("ranks_disagreeing_with_rank0"):
            problems.append({"kind": "intra_replica", "replica": rid, "field": "layer_groups",
                             "message": f"replica {rid}: worker ranks "
                             f"{spec['ranks_disagreeing_with_rank0']} differ from rank 0"})
    for err in errors:
        problems.append({"kind": "no_answer", "replica": None, "field": None, "message": err})
    missing = (running or 0) - len(specs)
    if missing > 0 and not errors:
        problems.append({"kind": "silent", "replica": None, "field": None,
                         "message": f"{missing} RUNNING replica(s) did not answer kv_page_spec"})
    if running == 0 or (running is None and not specs):
        problems.append({"kind": "no_replicas", "replica": None, "field": None,
                         "message": "no RUNNING replica to compare"})
    if odd:
        state = DISAGREE
    elif errors or missing > 0 or not specs or running == 0:
        state = INCOMPLETE
    else:
        state = AGREE
    return {
        "agree": state == AGREE,
        "state": state,
        "expected": {"layout": expected_layout, "fingerprint": ref_fp},
        "running_replicas": running,
        "answered": len(specs),
        "replicas": [replica_row(s, s["replica_id"] in odd) for s in specs],
        "odd_replicas": odd,
        "problems": problems,
    }
