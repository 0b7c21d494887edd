"""Stand-in Serve replicas for the KV-spec controller: the replica contract, no engine.

The controller (``deployments.controller.KVSpecController``) only needs three
methods from the server deployment it watches: ``kv_page_spec()``,
``apply_kv_verdict(verdict)`` and ``check_health()``. A real ``DSv4Server``
replica needs a vLLM engine (~1 GiB, ~25 s to boot on CPU), so a 2-core box
fits two of them; a stand-in answers the same calls from recorded-shape worker
specs, so real Ray Serve and the real controller can be measured at 256 replicas.

The spec a stand-in returns goes through the same ``deployments.kvspec``
functions as a real replica's (``summarize_workers``), so the controller sees
the same dict shape, fingerprints and field names. ``variant`` makes chosen
ranks differ the way a mixed fleet does (bf16 plain rows instead of fp8_ds_mla),
which is how tests inject a disagreeing replica without a second GPU type.

Deliberately free of vLLM, torch and ``ray.serve.llm`` imports: each replica
is one Ray worker process, and at 256 of them every MiB per process counts.
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve

from deployments import kvspec

# DeepSeek-V4-Flash's layer pattern (reference/models/): 43 layers, every one has a
# sliding-window cache; 21 are C4 (main + indexer cache + compressor states) and
# 20 are C128 (main cache + compressor state); the first two are SWA-only.
FLASH_C4_LAYERS = 21
FLASH_C128_LAYERS = 20
FLASH_SWA_ONLY_LAYERS = 2
BLOCK_SIZE = 256

# Page bytes per cache for a 256-token block (DESIGN.md section 1; 584 B per
# fp8_ds_mla state padded to 576 B multiples; bf16 plain rows are 1024 B per state).
# The sliding-window cache uses 64-token blocks (vLLM's DeepseekV4SWACache); the
# indexer cache and compressor states carry no cache dtype (state-only specs).
PAGES = {
    "fp8_ds_mla": {"swa": 37440, "c4": 37440, "c4_indexer": 8640, "c128": 1728},
    "bfloat16": {"swa": 65536, "c4": 65536, "c4_indexer": 8640, "c128": 2048},
}


def _row(layer: str, spec_type: str, dtype: str | None, page: int, ratio: int | None,
         head_size: int, block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    """One worker spec row as ``dsv4_patch.worker_ext.spec_to_dict`` emits it."""
    return {
        "layer": layer, "spec_type": spec_type, "cache_dtype_str": dtype,
        "page_size_bytes": page, "real_page_size_bytes": page, "block_size": block_size,
        "head_size": head_size, "num_kv_heads": 1, "dtype": "torch.bfloat16",
        "alignment": 576 if dtype == "fp8_ds_mla" else None, "sliding_window": None,
        "cache_role": None, "model_version": None, "compress_ratio": ratio,
    }


def flash_worker_specs(cache_dtype: str = "fp8_ds_mla") -> list[dict[str, Any]]:
    """Per-layer KV spec rows of one worker, shaped like DeepSeek-V4-Flash's.

    ``cache_dtype`` "fp8_ds_mla" is the FlashMLA/CPU layout; "bfloat16" is what a
    B200 with the FlashInfer sparse override stores: the disagreement the
    controller exists to catch.
    """
    pages = PAGES[cache_dtype]
    rows: list[dict[str, Any]] = []
    layers = FLASH_SWA_ONLY_LAYERS + FLASH_C4_LAYERS + FLASH_C128_LAYERS
    for i in range(layers):
        prefix = f"model.layers.{i}.attn"
        rows.append(_row(f"{prefix}.swa_cache", "SlidingWindowMLASpec", cache_dtype,
                         pages["swa"], None, 512, block_size=64))
        if i < FLASH_SWA_ONLY_LAYERS:
            continue
        if (i - FLASH_SWA_ONLY_LAYERS) % 2 == 0 and i < FLASH_SWA_ONLY_LAYERS + 2 * 21:
            rows.append(_row(f"{prefix}.mla_attn", "MLAAttentionSpec", cache_dtype,
                             pages["c4"], 4, 512))
            rows.append(_row(f"{prefix}.indexer.k_cache", "MLAAttentionSpec", None,
                             pages["c4_indexer"], 4, 132))
            rows.append(_row(f"{prefix}.compressor.state", "SlidingWindowMLASpec", None,
                             4096, None, 1024, block_size=4))
            rows.append(_row(f"{prefix}.indexer.compressor.state", "SlidingWindowMLASpec",
                             None, 2048, None, 256, block_size=4))
        else:
            rows.append(_row(f"{prefix}.mla_attn", "MLAAttentionSpec", cache_dtype,
                             pages["c128"], 128, 512))
            rows.append(_row(f"{prefix}.compressor.state", "SlidingWindowMLASpec", None,
                             4096, None, 1024, block_size=8))
    return rows


def count_layer_kinds(rows: list[dict[str, Any]]) -> dict[str, int]:
    """How many C4 and C128 main caches the rows hold (a self-check of the shape)."""
    main = [r for r in rows if r["layer"].endswith("mla_attn")]
    return {"c4": sum(r["compress_ratio"] == 4 for r in main),
            "c128": sum(r["compress_ratio"] == 128 for r in main)}


class StandInReplica:
    """A Serve replica answering the controller's calls like ``DSv4Server`` does.

    ``variants`` maps a replica rank to the cache dtype that rank stores; every
    other rank stores ``cache_dtype``. Ranks are Serve's (0..N-1, reused when a
    replica is replaced), exactly what ``DSv4Server`` reads for its overrides.
    """

    def __init__(self, cache_dtype: str = "fp8_ds_mla",
                 variants: dict[int, str] | None = None):
        ctx = serve.get_replica_context()
        self._replica_id = ctx.replica_id.unique_id
        self._rank = ctx.rank.rank if ctx.rank is not None else None
        dtype = (variants or {}).get(self._rank, cache_dtype) if self._rank is not None \
            else cache_dtype
        workers = [{"rank": 0, "pid": os.getpid(), "specs": flash_worker_specs(dtype),
                    "patch_record": None}]
        self._summary = kvspec.summarize_workers(workers) | {
            "workers": [{"rank": 0, "pid": os.getpid(), "patch_record": None}],
        }
        self._dtype = dtype
        self._verdict: dict[str, Any] = {}

    async def kv_page_spec(self) -> dict[str, Any]:
        """The same keys ``DSv4Server.kv_page_spec`` returns (engine fields stand-in)."""
        return self._summary | {
            "replica_id": self._replica_id,
            "rank": self._rank,
            "node_id": None,
            "pid": os.getpid(),
            "versions": {"vllm": None, "ray": None, "dsv4_serve": None},
            "node": {"platform": "standin", "compute_capability": None,
                     "attention_backend": None, "source": "standin"},
            "kv_cache_dtype_requested": "auto",
            "kv_cache_dtype_engine": "fp8" if self._dtype == "fp8_ds_mla" else self._dtype,
            "resolution_reason": "stand-in replica",
            "override": None,
            "verdict": self._verdict,
        }

    async def apply_kv_verdict(self, verdict: dict[str, Any]) -> dict[str, Any]:
        """Remember whether the controller named this replica (``DSv4Server`` contract)."""
        reason = verdict.get("odd_replicas", {}).get(self._replica_id)
        self._verdict = {"policy": verdict.get("policy"), "reason": reason,
                         "checked_at": verdict.get("checked_at")}
        return {"replica_id": self._replica_id, "odd": bool(reason)}

    async def check_health(self) -> None:
        """Fail under ``enforce`` when named odd, so Serve replaces this replica."""
        reason = self._verdict.get("reason")
        if reason and self._verdict.get("policy") == "enforce":
            raise RuntimeError(f"stand-in replica {self._replica_id} named odd: {reason}")

    async def __call__(self) -> dict[str, Any]:
        """Rank and dtype, so a test can see which replica answered a request."""
        return {"replica_id": self._replica_id, "rank": self._rank, "cache_dtype": self._dtype}
