"""What a replica's workers report, summarized: layer entries, fingerprints, the replica's
KV summary.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from deployments.control.wire import (
    LayerEntry,
    WorkerRow,
    WorkerSpec,
)
from dsv4_patch import rules

# What makes two caches interchangeable: a request's pages could move between
# them (P/D transfer, migration) layer for layer, and capacity planning holds.
COMPARED = ("spec_type", "cache_dtype_str", "page_size_bytes", "block_size", "head_size",
            "compress_ratio")
# The fields the byte model predicts (main + indexer caches of each layer).
PREDICTED = ("cache_dtype_str", "page_size_bytes", "block_size", "compress_ratio")

# Module suffixes vLLM gives DeepSeek-V4's caches (vllm/models/deepseek_v4/attention.py,
# compressor.py, vLLM 0.30-0.32), most specific first.
_ROLES = ((".indexer.compressor.state_cache", "indexer_compressor_state"),
          (".indexer.k_cache", rules.INDEXER), (".compressor.state_cache", "compressor_state"),
          (".swa_cache", "swa"))
_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
SHOWN_LAYERS = 4  # layer differences spelled out in a message (all are in `layers`)


class WorkerSpecError(ValueError):
    """A worker's answer to ``dsv4_kv_specs`` is not what the extension returns."""


def layer_role(name: str) -> tuple[int | None, str]:
    """(decoder layer index, cache role) of a KV-spec layer name."""
    match = _INDEX.search(name)
    index = int(match.group(1)) if match else None
    role = next((r for suffix, r in _ROLES if name.endswith(suffix)), rules.MAIN)
    return index, role


def entry(spec: Mapping[str, Any] | Any) -> LayerEntry:
    """One worker spec row as the per-layer fingerprint entry."""
    row = spec if isinstance(spec, Mapping) else spec.model_dump()
    index, role = layer_role(row["layer"])
    return LayerEntry(layer=row["layer"], index=index, role=role,
                      **{f: row.get(f) for f in COMPARED})


def fingerprint(entries: Iterable[LayerEntry]) -> str:
    """sha256 of the per-layer mapping (layer -> compared fields): equal iff layer for layer."""
    # Attribute reads, not ``model_dump``: the same dicts (so the same hash across
    # versions) at a tenth of the cost; the controller re-hashes every full answer.
    rows = sorted(({"layer": e.layer, **{f: getattr(e, f) for f in COMPARED}}
                   for e in entries), key=lambda r: r["layer"])
    canonical = json.dumps(rows, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def _sort_key(e: LayerEntry) -> tuple[int, str]:
    return (e.index if e.index is not None else -1, e.layer)


def parse_workers(answers: Sequence[Any]) -> list[WorkerSpec]:
    """Validate the workers' answers on receipt; name the first malformed one."""
    if not answers:
        raise WorkerSpecError("no worker answered dsv4_kv_specs; expected one dict per rank")
    workers = []
    for i, answer in enumerate(answers):
        try:
            workers.append(WorkerSpec.model_validate(answer))
        except ValidationError as exc:
            raise WorkerSpecError(
                f"worker answer {i} ({str(answer)[:200]!r}) is not a WorkerSpec: "
                f"{exc.errors(include_url=False)[0]['msg']} at "
                f"{exc.errors(include_url=False)[0]['loc']}; expected the dict returned by "
                "dsv4_patch.worker_ext.DSv4WorkerExtension.dsv4_kv_specs"
            ) from exc
    return workers


@dataclass
class ReplicaKV:
    """One replica's merged KV spec (the part of ``ReplicaSpec`` its workers decide)."""

    layers: list[LayerEntry]
    fingerprint: str
    cache_dtypes: list[str]
    page_sizes: list[int]
    block_sizes: list[int]
    workers: list[WorkerRow]
    ranks_disagreeing: list[int] = field(default_factory=list)

    def fields(self) -> dict[str, Any]:
        return {"layers": self.layers, "fingerprint": self.fingerprint,
                "cache_dtypes": self.cache_dtypes, "page_sizes": self.page_sizes,
                "block_sizes": self.block_sizes, "workers": self.workers,
                "ranks_disagreeing": self.ranks_disagreeing,
                "worker_node_ids": [w.node_id for w in self.workers]}


def summarize_workers(answers: Sequence[Any]) -> ReplicaKV:
    """One replica's KV spec from its workers' answers.

    Tensor-parallel ranks report the same layers, pipeline stages different ones:
    the replica's mapping is the union, and a layer two ranks report differently
    makes those ranks ``ranks_disagreeing`` (vLLM asserts ranks agree; we check,
    because the whole point is not to trust that replicas are alike).
    """
    workers = parse_workers(answers)
    merged: dict[str, LayerEntry] = {}
    split: set[int] = set()
    rows = []
    for worker in workers:
        entries = [entry(s) for s in worker.specs]
        for e in entries:
            first = merged.setdefault(e.layer, e)
            if first != e:
                split.add(worker.rank)
        rows.append(WorkerRow(rank=worker.rank, pid=worker.pid, node_id=worker.node_id,
                              fingerprint=fingerprint(entries),
                              patch_record=worker.patch_record))
    layers = sorted(merged.values(), key=_sort_key)
    return ReplicaKV(
        layers=layers,
        fingerprint=fingerprint(layers),
        cache_dtypes=sorted({e.cache_dtype_str for e in layers if e.cache_dtype_str}),
        page_sizes=sorted({e.page_size_bytes for e in layers if e.page_size_bytes}),
        block_sizes=sorted({e.block_size for e in layers if e.block_size}),
        workers=rows,
        ranks_disagreeing=sorted(split),
    )
