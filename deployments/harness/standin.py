"""Stand-in Serve replicas for the KV-spec controller: the replica contract, no engine.

The controller (``deployments.control.controller.KVSpecController``) needs four methods
from the server deployment it watches: ``kv_page_spec()`` (a
``deployments.control.wire.ReplicaSpec``), ``apply_kv_verdict(message)``,
``record_routing_stats()`` and ``check_health()``. A real ``DSv4Server`` replica
needs a vLLM engine (~1 GiB, ~25 s to boot on CPU), so a 2-core box fits two of
them; a stand-in answers the same calls, so real Ray Serve and the real
controller can be exercised and measured at 256 replicas.

The worker specs a stand-in reports are laid out layer by layer the way vLLM's
DeepSeek-V4 layers register them (names, roles, block sizes: recorded from the
real engine on the tiny model, ``tests/support/data/tiny_worker_specs.json``) for the
real DeepSeek-V4-Flash ``config.json``, with page sizes from the byte model; its
prediction comes from the same ``deployments.control.prediction.predict`` a real replica
uses. Knobs make chosen ranks differ the ways a fleet can:

* ``variants``: rank -> cache dtype (``auto``/``bfloat16``: bf16 rows, a B200 with
  FlashInfer rows; under ``expected_layout: fp8_ds_mla`` such a replica refuses
  to start under enforce, as ``DSv4Server`` does);
* ``reordered``: ranks whose model has two layer kinds swapped (the
  ``compress_ratios`` reorder: same multiset of caches, other layers);
* ``canaries``: ranks that declare a ``replica_overrides`` entry;
* ``split``: ranks whose second worker reports another spec (intra-replica);
* ``hang_s``: rank -> seconds ``kv_page_spec`` stalls, from its second call on
  (the first answers, so the controller knows the replica it then waits for);
  with ``hang_flag``, only while that file exists instead (a test first sees every
  replica answer, however slow the box made that first answer, then starts the hang).

Like ``DSv4Server``, a stand-in refuses to start under ``enforce`` when it
contradicts its own config (split ranks, caches its own prediction rules out):
that is what holds a rolling update back.

Deliberately free of vLLM, torch and ``ray.serve.llm`` imports: each replica
is one Ray worker process, and at 256 of them every MiB per process counts.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any, cast

from ray import serve

from deployments import resources
from deployments.control.enforcement import (
    KVLayoutMismatch,
    drain_stats,
    raise_if_enforced,
    take_verdict,
)
from deployments.control.prediction import predict, self_problem
from deployments.control.summary import summarize_workers
from deployments.control.wire import ReplicaSpec, ReplicaVerdict, answer_kv_page_spec
from deployments.plan.model_configs import read_config_json
from dsv4_patch import rules

MODELS = resources.configs_dir() / "models" / "deepseek-ai"
FLASH_CONFIG = MODELS / "DeepSeek-V4-Flash" / "config.json"
V41_FLASH_CONFIG = MODELS / "DeepSeek-V4.1-Flash" / "config.json"
# Nodes a V4.1 stand-in can present (NodeInfo.as_dict() as a replica reports it).
V41_NODES: dict[str, dict[str, Any]] = {
    "h200": {"platform": "cuda", "compute_capability": "9.0", "attention_backend": None},
    "b200": {"platform": "cuda", "compute_capability": "10.0", "attention_backend": None},
    "b200-flashmla": {"platform": "cuda", "compute_capability": "10.0",
                      "attention_backend": "FLASHMLA_SPARSE_DSV41"},
    "b200-rows": {"platform": "cuda", "compute_capability": "10.0",
                  "attention_backend": "FLASHINFER_MLA_SPARSE_DSV41"},
}
STANDIN_VLLM = "0.32.0"
BLOCK_SIZE = rules.DSV4_BLOCK_SIZE
SWA_BLOCK = 64  # DeepseekV4SWACache block size (recorded)
# Compressor-state caches as the real engine reports them (recorded; not predicted).
STATE_PAGES = {"c4_state": (32832, 4, 2048), "c4_indexer_state": (8640, 4, 512),
               "c128_state": (32832, 8, 1024)}


def flash_config(reordered: bool = False) -> dict[str, Any]:
    """DeepSeek-V4-Flash's config.json; ``reordered`` swaps layers 2 (C4) and 3 (C128)."""
    cfg = read_config_json(FLASH_CONFIG)
    if reordered:
        ratios = list(cfg["compress_ratios"])
        ratios[2], ratios[3] = ratios[3], ratios[2]
        cfg["compress_ratios"] = ratios
    return cfg


def _row(layer: str, spec_type: str, dtype: str | None, page: int, block: int,
         head: int, ratio: int) -> dict[str, Any]:
    """One worker spec row as ``dsv4_patch.worker_ext.spec_to_dict`` emits it."""
    return {"layer": layer, "spec_type": spec_type, "cache_dtype_str": dtype,
            "page_size_bytes": page, "real_page_size_bytes": page, "block_size": block,
            "head_size": head, "num_kv_heads": 1, "dtype": "torch.uint8",
            "alignment": rules.page_alignment(
                rules.Storage.FP8_DS_MLA if dtype == "fp8_ds_mla" else rules.Storage.FP8_ROWS),
            "sliding_window": None, "compress_ratio": ratio}


def flash_worker_specs(cache_dtype: str = "fp8_ds_mla",
                       cfg: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per-layer KV spec rows of one worker for a DeepSeek-V4 config (Flash by default).

    ``cache_dtype`` "fp8_ds_mla" is the FlashMLA/CPU layout; "bfloat16" is what a
    B200 with the FlashInfer sparse override stores.
    """
    cfg = cfg or flash_config()
    shape = rules.ModelShape.from_hf_config(cfg)
    storage = rules.Storage.FP8_DS_MLA if cache_dtype == "fp8_ds_mla" else \
        rules.Storage.BF16_ROWS
    pages = {r.ratio: r for r in rules.page_breakdown(shape, storage, BLOCK_SIZE)}
    swa = rules.padded_page_bytes(SWA_BLOCK, rules.state_bytes(shape, storage),
                                  rules.page_alignment(storage))
    rows: list[dict[str, Any]] = []
    for i, ratio in enumerate(shape.compress_ratios):
        attn = f"model.layers.{i}.attn"
        rows.append(_row(f"{attn}.swa_cache", "SlidingWindowMLASpec", cache_dtype, swa,
                         SWA_BLOCK, shape.head_dim, 1))
        if ratio <= 1:
            continue
        rows.append(_row(attn, "MLAAttentionSpec", cache_dtype, pages[ratio].main_page_bytes,
                         BLOCK_SIZE, shape.head_dim, ratio))
        kind = "c4" if ratio == 4 else "c128"
        page, block, head = STATE_PAGES[f"{kind}_state"]
        rows.append(_row(f"{attn}.compressor.state_cache", "SlidingWindowMLASpec", None,
                         page, block, head, 1))
        if ratio == 4:
            rows.append(_row(f"{attn}.indexer.k_cache", "MLAAttentionSpec", None,
                             pages[4].indexer_page_bytes, BLOCK_SIZE,
                             shape.index_head_dim + rules.INDEXER_SCALE_BYTES, 4))
            page, block, head = STATE_PAGES["c4_indexer_state"]
            rows.append(_row(f"{attn}.indexer.compressor.state_cache",
                             "SlidingWindowMLASpec", None, page, block, head, 1))
    return rows


def v41_worker_specs(node: dict[str, Any], cache_dtype: str | None = "auto",
                     record_of: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per-layer KV spec rows of one V4.1-Flash worker on ``node`` (names as vLLM gives them).

    Pages from ``rules.v41_caches`` (equal to vLLM's own spec classes:
    tests/test_dsv4_patch/test_rules_v41.py). ``record_of``: a node whose engine
    writes another node's record (an odd replica: a build without vllm#56893).
    """
    cfg = json.loads(V41_FLASH_CONFIG.read_text())
    src = record_of or node
    cap = src.get("compute_capability")
    capability = cast("tuple[int, int]", tuple(int(x) for x in cap.split("."))) if cap else None
    record = rules.v41_record(src["platform"], capability, src.get("attention_backend"),
                              cache_dtype)
    suffix = {"main": "", "swa": ".swa_cache", "indexer": ".indexer.k_cache",
              "compressor_state": ".compressor.state_cache"}
    spec_type = {"main": "MLAAttentionSpec", "swa": "SlidingWindowMLASpec",
                 "indexer": "MLAAttentionSpec", "compressor_state": "CircularBufferSpec"}
    rows = []
    for c in rules.v41_caches(rules.V41Topology.from_hf_config(cfg), record):
        rows.append({"layer": f"model.layers.{c.index}.self_attn{suffix[c.role]}",
                     "spec_type": spec_type[c.role], "cache_dtype_str": c.cache_dtype_str,
                     "page_size_bytes": c.page_size_bytes,
                     "real_page_size_bytes": c.page_size_bytes, "block_size": c.block_size,
                     "head_size": None, "num_kv_heads": 1, "dtype": "torch.uint8",
                     "alignment": record.alignment, "sliding_window": None,
                     "compress_ratio": c.compress_ratio})
    return rows


def v41_standin_spec(replica_id: str, rank: int | None, node: str, *,
                     odd_record: str | None = None, policy: str = "enforce",
                     expected_layouts: dict[str, str] | None = None,
                     vllm: str = "0.33.0") -> ReplicaSpec:
    """A V4.1-Flash replica on ``node`` (a ``V41_NODES`` key), predicted from that node."""
    here = V41_NODES[node]
    kv = summarize_workers([{"rank": 0, "pid": os.getpid(), "specs": v41_worker_specs(
        here, record_of=V41_NODES[odd_record] if odd_record else None)}])
    prediction = predict(read_config_json(V41_FLASH_CONFIG), rules.Layout.FP8_DS_MLA,
                         "auto", vllm, source="DeepSeek-V4.1-Flash config.json (stand-in)",
                         node=here)
    key = f"sm{here['compute_capability'].partition('.')[0]}0"
    expected = (expected_layouts or {}).get(key, prediction.cache_dtype_str or "fp8_ds_mla")
    return ReplicaSpec(
        replica_id=replica_id, rank=rank, node_id=None, pid=os.getpid(), policy=policy,
        expected_layout=expected, versions={"vllm": vllm, "ray": None, "dsv4_serve": None},
        node=here, kv_cache_dtype_requested="auto", kv_cache_dtype_engine="auto",
        prediction=prediction, **kv.fields())


def standin_spec(replica_id: str, rank: int | None, *, dtype: str = "fp8_ds_mla",
                 reordered: bool = False, canary: bool = False, split: bool = False,
                 policy: str = "enforce", expected_layout: str = "fp8_ds_mla",
                 workers: int = 1) -> ReplicaSpec:
    """The ``ReplicaSpec`` a stand-in (or a unit test) reports, built the real way."""
    cfg = flash_config(reordered)
    answers = [{"rank": r, "pid": os.getpid(), "specs": flash_worker_specs(dtype, cfg)}
               for r in range(max(workers, 2 if split else 1))]
    if split:
        answers[1]["specs"] = flash_worker_specs("bfloat16", cfg)
    kv = summarize_workers(answers)
    deployment = predict(flash_config(), rules.Layout(expected_layout), "auto",
                                STANDIN_VLLM, source="DeepSeek-V4-Flash config.json (stand-in)")
    own = predict(cfg, rules.Layout(expected_layout), "auto", STANDIN_VLLM,
                         source="stand-in override") if canary else None
    return ReplicaSpec(
        replica_id=replica_id, rank=rank, node_id=None, pid=os.getpid(),
        policy=policy, expected_layout=expected_layout,
        versions={"vllm": STANDIN_VLLM, "ray": None, "dsv4_serve": None},
        node={"platform": "standin"}, kv_cache_dtype_requested="auto",
        kv_cache_dtype_engine="fp8" if dtype == "fp8_ds_mla" else dtype,
        override={"rank": rank, "engine_kwargs": {"hf_overrides": "stand-in"},
                  "reason": "canary"} if canary else None,
        prediction=deployment, own_prediction=own, **kv.fields())


class StandInReplica:
    """A Serve replica answering the controller's calls like ``DSv4Server`` does."""

    def __init__(self, cache_dtype: str = "fp8_ds_mla", variants: dict[int, str] | None = None,
                 reordered: tuple[int, ...] = (), canaries: tuple[int, ...] = (),
                 split: tuple[int, ...] = (), hang_s: dict[int, float] | None = None,
                 hang_flag: str | None = None, policy: str = "enforce",
                 expected_layout: str = "fp8_ds_mla", v41_nodes: dict[int, str] | None = None,
                 v41_odd: dict[int, str] | None = None,
                 expected_layouts: dict[str, str] | None = None):
        ctx = serve.get_replica_context()
        self._replica_id = ctx.replica_id.unique_id
        self._rank = ctx.rank.rank if ctx.rank is not None else None
        self._dtype = (variants or {}).get(self._rank, cache_dtype) \
            if self._rank is not None else cache_dtype
        self._hang_s = (hang_s or {}).get(self._rank, 0.0) if self._rank is not None else 0.0
        self._hang_flag = Path(hang_flag) if hang_flag else None
        self._policy = policy
        self._spec = standin_spec(
            self._replica_id, self._rank, dtype=self._dtype, reordered=self._rank in reordered,
            canary=self._rank in canaries, split=self._rank in split, policy=policy,
            expected_layout=expected_layout) if not v41_nodes else v41_standin_spec(
                self._replica_id, self._rank, v41_nodes[self._rank or 0],
                odd_record=(v41_odd or {}).get(self._rank or 0), policy=policy,
                expected_layouts=expected_layouts)
        self._spec = self._spec.model_copy(
            update={"deployment_version": getattr(ctx, "code_version", None)})
        self._verdict = ReplicaVerdict()
        self._calls = 0
        problem = self_problem(self._spec)
        if problem and policy == "enforce":
            raise KVLayoutMismatch(f"stand-in {self._replica_id} (rank {self._rank}) "
                                          f"refuses to start under enforce: {problem}")

    async def kv_page_spec(self, known: dict[str, str] | None = None) -> dict[str, Any]:
        """What ``DSv4Server.kv_page_spec`` returns (stalls if told to)."""
        self._calls += 1
        if self._hang_s and self._stalls():
            await asyncio.sleep(self._hang_s)
        return answer_kv_page_spec(self._spec.model_copy(update={"verdict": self._verdict}),
                                   known)

    def _stalls(self) -> bool:
        if self._hang_flag is not None:
            return self._hang_flag.exists()
        return self._calls > 1

    async def apply_kv_verdict(self, message: dict[str, Any]) -> dict[str, Any]:
        self._verdict = take_verdict(message, self._replica_id, self._policy,
                                            self._verdict)
        return {"replica_id": self._replica_id, "odd": self._verdict.odd,
                "action": self._verdict.action.value}

    async def record_routing_stats(self) -> dict[str, Any]:
        return drain_stats(self._verdict)

    async def check_health(self) -> None:
        raise_if_enforced(self._verdict)

    async def __call__(self) -> dict[str, Any]:
        """Rank and dtype, so a test can see which replica answered a request."""
        return {"replica_id": self._replica_id, "rank": self._rank, "cache_dtype": self._dtype}
