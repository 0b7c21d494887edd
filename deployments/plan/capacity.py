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

from deployments.config import AppArgs
from deployments.config.sizing import Parallel
from deployments.plan.weights import WeightEstimate, weights_per_gpu
from dsv4_patch import rules

GIB = 2**30
VLLM_DEFAULT_GPU_UTILIZATION = 0.9  # vLLM EngineArgs.gpu_memory_utilization default


def pp_stage_ratios(shape: rules.ModelShape, pp: int) -> list[tuple[int, ...]]:
    """Compress ratios per pipeline stage, split like vLLM's ``get_pp_indices``.

    vllm/distributed/utils.py: layers // pp per stage, the remainder added one by
    one to the stages before the last.
    """
    sizes = [shape.num_layers // pp] * pp
    for i in range(2, shape.num_layers % pp + 2):
        sizes[-i] += 1
    stages, start = [], 0
    for size in sizes:
        stages.append(shape.compress_ratios[start:start + size])
        start += size
    return stages


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


def kv_budget_per_gpu(args: AppArgs, weights_gpu: float, reserve_gib: float) -> float | None:
    """Bytes one GPU (or the CPU KV space) has for KV pages, or None if undeclared."""
    node = args.dsv4.node
    if node.platform == "cpu":
        space = (args.llm.runtime_env.get("env_vars") or {}).get("VLLM_CPU_KVCACHE_SPACE")
        return float(space) * GIB if space else None
    if node.gpu_memory_gib is None:
        return None
    util = float(engine_extra(args, "gpu_memory_utilization", VLLM_DEFAULT_GPU_UTILIZATION))
    return node.gpu_memory_gib * GIB * util - weights_gpu - reserve_gib * GIB


def capacity(args: AppArgs, shape: rules.ModelShape, weights: WeightEstimate,
             storage: rules.Storage, block: int, reserve_gib: float,
             par: Parallel | None = None) -> Capacity:
    """KV tokens per engine and per replica for ``storage`` on the declared node.

    ``par`` replaces the configured parallel layout (for counterfactuals).
    """
    par = par or args.parallel()
    per_token = rules.kv_bytes_per_token(shape, storage, block)
    per_gpu_token = stage_bytes_per_token(shape, storage, block, par.pp)
    on_gpu = args.dsv4.node.platform != "cpu"
    w_gpu = weights_per_gpu(weights, par) if on_gpu else None
    budget = kv_budget_per_gpu(args, w_gpu or 0.0, reserve_gib)
    tokens = None if budget is None else max(0, math.floor(budget / per_gpu_token))
    return Capacity(
        storage=storage.value,
        kv_bytes_per_token=per_token,
        kv_bytes_per_token_per_gpu=per_gpu_token,
        weights_per_gpu_bytes=w_gpu,
        kv_budget_per_gpu_bytes=budget,
        kv_tokens_per_engine=tokens,
        kv_tokens_per_replica=None if tokens is None else tokens * par.dp,
    )
