"""KV capacity of one engine and one replica on the declared node.

Capacity model (per GPU, documented so the numbers can be checked by hand)::

    budget  = gpu_memory_gib * 2**30 * gpu_memory_utilization
              - weights_per_gpu - reserve_gib * 2**30
    tokens_per_engine  = floor(budget / kv_bytes_per_token_of_the_fullest_pp_stage)
    tokens_per_replica = tokens_per_engine * data_parallel_size

DeepSeek-V4 has one KV head (MLA): every tensor-parallel rank holds the whole KV
cache of its pipeline stage, so TP adds no tokens; every data-parallel rank is its
own engine with its own pool, so DP multiplies them. vLLM sizes its pool after
profiling activations (CUDA graphs, MoE workspaces); ``--reserve-gib`` subtracts
an allowance for that, and with the default 0 the token counts are upper bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from deployments.config import AppArgs, NodeSpec
from deployments.config.sizing import Parallel
from deployments.plan.weights import WeightEstimate, weights_per_gpu
from dsv4_patch import rules

GIB = 2**30


def pp_stage_ranges(num_layers: int, pp: int) -> list[range]:
    """Layer indices per pipeline stage, split like vLLM's ``get_pp_indices``.

    vllm/distributed/utils.py: layers // pp per stage, the remainder added one by
    one to the stages before the last.
    """
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    stages, start = [], 0
    for size in sizes:
        stages.append(range(start, start + size))
        start += size
    return stages


def pp_stage_ratios(shape: rules.ModelShape, pp: int) -> list[tuple[int, ...]]:
    """Compress ratios per pipeline stage (``pp_stage_ranges``)."""
    return [shape.compress_ratios[r.start:r.stop] for r in pp_stage_ranges(shape.num_layers, pp)]


def stage_bytes_per_token(shape: rules.ModelShape, storage: rules.Storage, block: int,
                          pp: int) -> float:
    """KV bytes per context token on the fullest pipeline stage (bounds the pool)."""
    return max(
        rules.kv_bytes_per_token(
            replace(shape, num_layers=len(r), compress_ratios=r), storage, block
        )
        for r in pp_stage_ratios(shape, pp)
    )


@dataclass
class Capacity:
    """KV capacity of one engine and one replica on the declared node."""

    storage: str
    kv_bytes_per_token: float  # whole model on one rank (rules.kv_bytes_per_token)
    kv_bytes_per_token_per_gpu: float  # fullest pipeline stage
    weights_per_gpu_bytes: float | None
    kv_budget_per_gpu_bytes: float | None
    kv_tokens_per_engine: int | None
    kv_tokens_per_replica: int | None


def engine_extra(args: AppArgs, key: str, default: Any = None) -> Any:
    return (args.llm.engine_kwargs.model_extra or {}).get(key, default)


def kv_budget_per_gpu(args: AppArgs, weights_gpu: float, reserve_gib: float,
                      node: NodeSpec | None = None, release: str | None = None
                      ) -> float | None:
    """Bytes one GPU (or the CPU KV space) has for KV pages, or None if undeclared.

    ``node``: one node type of a mixed fleet (default ``dsv4.node``). Unset
    ``gpu_memory_utilization`` is the release's own default
    (``rules.default_gpu_memory_utilization``: 0.92; 1.0 on 0.34 CUDA/ROCm).
    """
    node = node or args.dsv4.node
    if node.platform == "cpu":
        space = (args.llm.runtime_env.get("env_vars") or {}).get("VLLM_CPU_KVCACHE_SPACE")
        return float(space) * GIB if space else None
    if node.gpu_memory_gib is None:
        return None
    release = release or args.dsv4.vllm_version or rules.DEFAULT_VLLM[node.platform]
    nixl = bool(getattr(args, "pd", None) and node.platform == "rocm")
    default = 0.92 if nixl else rules.default_gpu_memory_utilization(release, node.platform)
    util = float(engine_extra(args, "gpu_memory_utilization", default))
    return node.gpu_memory_gib * GIB * util - weights_gpu - reserve_gib * GIB


def capacity(args: AppArgs, shape: rules.ModelShape, weights: WeightEstimate,
             storage: rules.Storage, block: int, reserve_gib: float,
             par: Parallel | None = None, node: NodeSpec | None = None,
             release: str | None = None) -> Capacity:
    """KV tokens per engine and per replica for ``storage`` on the declared node.

    ``par`` replaces the configured parallel layout (for counterfactuals); ``node``
    the declared node (one node type of a mixed fleet).
    """
    per_token = rules.kv_bytes_per_token(shape, storage, block)
    par = par or args.parallel()
    return _fill(args, storage.value, per_token,
                 stage_bytes_per_token(shape, storage, block, par.pp), weights, reserve_gib,
                 par, node or args.dsv4.node, release)


def v41_stage_bytes_per_token(caches: list[rules.V41Cache], num_layers: int,
                              pp: int) -> float:
    """DeepSeek-V4.1: KV bytes per context token on the fullest pipeline stage."""
    return max(rules.v41_bytes_per_token([c for c in caches if c.index in stage])
               for stage in pp_stage_ranges(num_layers, pp))


def v41_capacity(args: AppArgs, caches: list[rules.V41Cache], num_layers: int,
                 weights: WeightEstimate, reserve_gib: float, node: NodeSpec,
                 par: Parallel | None = None, release: str | None = None) -> Capacity:
    """KV tokens per engine and replica of DeepSeek-V4.1 on ``node`` (its own caches,
    ``rules.build``).

    V4.1's growth per token is the pages of its growing caches (compressed KV on the
    KV-source layers and their indexer rows), not V4's formula: V4's gives 5265 B for
    V4.1-Flash on every GPU (2.9x SM90's 1827 B, 5x SM100's 1056 B) and hides that the
    two differ.
    """
    par = par or args.parallel()
    dtype = next((c.cache_dtype_str for c in caches if c.cache_dtype_str), "")
    return _fill(args, dtype, rules.v41_bytes_per_token(caches),
                 v41_stage_bytes_per_token(caches, num_layers, par.pp), weights,
                 reserve_gib, par, node, release)


def _fill(args: AppArgs, storage: str, per_token: float, per_gpu_token: float,
          weights: WeightEstimate, reserve_gib: float, par: Parallel,
          node: NodeSpec, release: str | None = None) -> Capacity:
    """The token counts of one bytes-per-token on one node and parallel layout."""
    on_gpu = node.platform != "cpu"
    w_gpu = weights_per_gpu(weights, par) if on_gpu else None
    budget = kv_budget_per_gpu(args, w_gpu or 0.0, reserve_gib, node, release)
    tokens = None if budget is None else max(0, math.floor(budget / per_gpu_token))
    return Capacity(
        storage=storage,
        kv_bytes_per_token=per_token,
        kv_bytes_per_token_per_gpu=per_gpu_token,
        weights_per_gpu_bytes=w_gpu,
        kv_budget_per_gpu_bytes=budget,
        kv_tokens_per_engine=tokens,
        kv_tokens_per_replica=None if tokens is None else tokens * par.dp,
    )
