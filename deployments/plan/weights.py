"""Weight bytes of a DeepSeek-V4 checkpoint, and how a parallel layout splits them.

Weight model (``estimate_weights``): parameter counts from the config's shapes,
following vLLM's DeepSeek-V4 modules (vllm/models/deepseek_v4: attention.py,
compressor.py, nvidia/model.py) and the checkpoint format (FP4+FP8 mixed: MoE
experts MXFP4 = 4 bit + one UE8M0 scale per 32 values, other linears FP8 with one
scale per 128x128 block, compressors/indexer gate/router/embeddings bf16):
Flash 284.3 B parameters, ~156 GB; Pro 1.57 T, ~850 GB (the published sizes are
284 B and ~865 GB on disk with the MTP layer, which is loaded only with
speculative decoding and excluded here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deployments.config.sizing import Parallel

# Bytes per parameter of each storage format.
MXFP4 = 0.5 + 1 / 32  # 4-bit values + one UE8M0 scale byte per 32
FP8_BLOCK = 1 + 1 / (128 * 128)  # e4m3 + one scale byte per 128x128 block
BF16 = 2.0


@dataclass(frozen=True)
class WeightEstimate:
    """Weight bytes by how the parallel layout splits them."""

    routed_experts: float  # split by EP (or by TP without EP)
    shared_experts: float  # split by TP
    tp_sharded: float  # attention wq_b, wo_a, wo_b: split by TP
    replicated: float  # fused wq_a+wkv, compressors, indexer, router: on every rank
    vocab: float  # embedding + lm_head: vocab-parallel over TP
    parameters: int

    @property
    def total(self) -> float:
        return (self.routed_experts + self.shared_experts + self.tp_sharded
                + self.replicated + self.vocab)


def _formats(cfg: Mapping[str, Any]) -> tuple[float, float]:
    """(expert, linear) bytes per parameter from ``quantization_config``.

    DeepSeek-V4 fp8 checkpoints keep experts in MXFP4 unless ``expert_dtype`` says
    fp8 (vllm/models/deepseek_v4/quant_config.py, default "fp4"); no quantization
    config means a bf16 checkpoint (the tiny model).
    """
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return BF16, BF16
    expert = FP8_BLOCK if cfg.get("expert_dtype", "fp4") == "fp8" else MXFP4
    return expert, FP8_BLOCK


def estimate_weights(cfg: Mapping[str, Any]) -> WeightEstimate:
    """Weight bytes of a DeepSeek-V4 ``config.json`` (main layers, no MTP layer)."""
    h, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    inter, experts = int(cfg["moe_intermediate_size"]), int(cfg["n_routed_experts"])
    heads, hd = int(cfg["num_attention_heads"]), int(cfg["head_dim"])
    q_lora, o_lora, groups = int(cfg["q_lora_rank"]), int(cfg["o_lora_rank"]), int(cfg["o_groups"])
    ih, ihd = int(cfg["index_n_heads"]), int(cfg["index_head_dim"])
    ratios = [int(r) for r in cfg["compress_ratios"][:n]]
    expert_fmt, linear_fmt = _formats(cfg)

    routed = n * experts * 3 * h * inter
    shared = n * int(cfg.get("n_shared_experts", 0)) * 3 * h * inter
    sharded = n * (q_lora * heads * hd + heads * hd * o_lora + groups * o_lora * h)
    fused_qa_kv = n * h * (q_lora + hd)
    compressors = sum(h * 2 * (2 if r == 4 else 1) * hd for r in ratios if r > 1)
    indexer_fp8 = sum(q_lora * ih * ihd for r in ratios if r == 4)
    indexer_bf16 = sum(h * ih + h * 2 * 2 * ihd for r in ratios if r == 4)
    router = n * h * experts
    vocab = 2 * int(cfg["vocab_size"]) * h
    params = (routed + shared + sharded + fused_qa_kv + compressors + indexer_fp8
              + indexer_bf16 + router + vocab)
    return WeightEstimate(
        routed_experts=routed * expert_fmt,
        shared_experts=shared * linear_fmt,
        tp_sharded=sharded * linear_fmt,
        replicated=(fused_qa_kv + indexer_fp8) * linear_fmt
        + (compressors + indexer_bf16 + router) * BF16,
        vocab=vocab * BF16,
        parameters=params,
    )


def weights_per_gpu(w: WeightEstimate, par: Parallel) -> float:
    """Bytes of weights one GPU holds; stages split the layers evenly (pp <= 2 exact)."""
    experts = w.routed_experts / (par.ep_size if par.ep else par.tp)
    per_stage = (experts + (w.shared_experts + w.tp_sharded + w.vocab) / par.tp
                 + w.replicated)
    return per_stage / par.pp
