"""PyTorch versions of DeepSeek-V4's Triton attention-metadata kernels (the fallbacks' bodies)."""

from __future__ import annotations

from typing import Any

import torch

_PAD = -1


def _tdiv(a: torch.Tensor, b: Any) -> torch.Tensor:
    """Triton integer ``//``: truncates toward zero (C semantics), unlike torch's ``//``."""
    return torch.div(a, b, rounding_mode="trunc")


def _tmod(a: torch.Tensor, b: Any) -> torch.Tensor:
    """Triton integer ``%``: sign follows the dividend (C semantics), i.e. ``fmod``."""
    return torch.fmod(a, b)


def _request_of(starts: torch.Tensor, num_reqs: int, items: torch.Tensor) -> torch.Tensor:
    """Index of the request whose [starts[r], starts[r+1]) range holds each item."""
    return torch.searchsorted(starts[1 : num_reqs + 1].contiguous(), items, right=True)


def _rows(t: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """``n`` rows of ``width`` elements addressed like the kernels do: row * stride(0) + col."""
    return t.as_strided((n, width), (t.stride(0), 1))


def compute_token_to_req_indices(
    query_start_loc: torch.Tensor, out: torch.Tensor, num_mapped_tokens: int, num_tokens: int
) -> torch.Tensor:
    """v1/attention/ops/metadata.py: request of each token; tokens >= num_mapped map to 0."""
    token_request_mapping(query_start_loc, out, query_start_loc.shape[0] - 1,
                          num_mapped_tokens, num_tokens)
    return out[:num_tokens]


def token_request_mapping(
    query_start_loc: torch.Tensor, output: torch.Tensor, num_reqs: int, num_mapped: int,
    num_tokens: int,
) -> None:
    """metadata.py ``_token_request_mapping_kernel`` itself (0.30/0.31 launch it raw from
    ``CommonAttentionMetadata.token_to_req_indices``): the request of each of the first
    ``num_tokens`` tokens (``_token_request``'s binary search, capped at the last request),
    0 at or past ``num_mapped``."""
    tokens = torch.arange(num_tokens, dtype=query_start_loc.dtype, device=output.device)
    req = _request_of(query_start_loc, num_reqs, tokens).clamp_(max=num_reqs - 1)
    output[:num_tokens] = torch.where(tokens < num_mapped, req, 0)


def compute_swa_indices_and_lens(
    swa_indices: torch.Tensor, swa_lens: torch.Tensor, window_size: int, index_width: int,
    left_visible: torch.Tensor, right_visible: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, token_to_req_indices: torch.Tensor, is_valid_token: torch.Tensor,
    block_table: torch.Tensor, block_size: int, replay_start: torch.Tensor, *,
    num_tokens: int, token_offset: int, has_image: bool = False,
) -> None:
    """sparse_swa.py ``_compute_swa_indices_and_lens_kernel``: per token, the paged slots of
    its sliding window (clipped at the replay start) and the window length; -1 elsewhere."""
    tok = slice(token_offset, token_offset + num_tokens)
    valid = is_valid_token[tok]
    # Padded tokens may carry any request index: clamp so gathers stay in bounds (masked below).
    last = min(query_start_loc.shape[0] - 1, seq_lens.shape[0], replay_start.shape[0]) - 1
    req = token_to_req_indices[tok].long().clamp(0, last)
    pos = seq_lens[req] - query_start_loc[req + 1] + torch.arange(tok.start, tok.stop)
    start, end = pos - (window_size - 1), pos + 1
    if has_image:  # in-image tokens see further left (past the window) and right
        start = start - (left_visible[tok] - (window_size - 1)).clamp(min=0)
        end = end + right_visible[tok]
    start = torch.maximum(start.clamp(min=0), replay_start[req])
    length = end - start
    swa_lens[:num_tokens] = torch.where(valid, length, 0)
    offset = torch.arange(index_width)
    in_window = valid[:, None] & (offset[None, :] < length[:, None])
    at = start[:, None] + offset[None, :]
    col = _tdiv(at, block_size).clamp_(0, block_table.shape[1] - 1)
    blocks = block_table[req.clamp(max=block_table.shape[0] - 1)[:, None], col]
    slots = blocks * block_size + _tmod(at, block_size)
    _rows(swa_indices, num_tokens, index_width)[:] = torch.where(in_window, slots, _PAD)


def compute_swa_indices_and_lens_no_replay(
    swa_indices: torch.Tensor, swa_lens: torch.Tensor, window_size: int, index_width: int,
    left_visible: torch.Tensor, right_visible: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, token_to_req_indices: torch.Tensor, is_valid_token: torch.Tensor,
    block_table: torch.Tensor, block_size: int, *, num_tokens: int, token_offset: int,
    has_image: bool = False,
) -> None:
    """0.30.0's form of the kernel: before SWA bounded replay it had no ``replay_start``,
    and its window start is ``max(start, 0)``, i.e. the later kernel with every
    replay start 0 (the two kernels differ in exactly that load, read from the wheels)."""
    no_replay = torch.zeros(seq_lens.shape[0] + query_start_loc.shape[0], dtype=torch.int32,
                            device=seq_lens.device)
    compute_swa_indices_and_lens(
        swa_indices, swa_lens, window_size, index_width, left_visible, right_visible,
        query_start_loc, seq_lens, token_to_req_indices, is_valid_token, block_table,
        block_size, no_replay, num_tokens=num_tokens, token_offset=token_offset,
        has_image=has_image)


def compute_prefill_metadata_no_replay(
    prefill_gather_lens: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
    num_prefills: int, num_decodes: int, window_size: int,
) -> None:
    """0.30.0's ``ComputePrefillMetadataKernel`` (no ``replay_start``): per prefill, query
    length plus ``min(prefix, window - 1)``, the prefix not clamped at 0."""
    r = slice(num_decodes, num_decodes + num_prefills)
    query_len = query_start_loc[r.start + 1 : r.stop + 1] - query_start_loc[r]
    prefix = seq_lens[r] - query_len
    prefill_gather_lens[:num_prefills] = query_len + prefix.clamp(max=window_size - 1)


def compute_prefill_metadata(
    prefill_gather_lens: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
    replay_start: torch.Tensor, num_prefills: int, num_decodes: int, window_size: int,
) -> None:
    """sparse_swa.py ``ComputePrefillMetadataKernel``: per prefill, query length plus the
    visible (post-replay-start) prefix, capped at window - 1."""
    r = slice(num_decodes, num_decodes + num_prefills)
    query_len = query_start_loc[r.start + 1 : r.stop + 1] - query_start_loc[r]
    visible = (seq_lens[r] - query_len - replay_start[r]).clamp(min=0)
    prefill_gather_lens[:num_prefills] = query_len + visible.clamp(max=window_size - 1)


def compressed_slot_mapping(
    compressed_slot_mapping: torch.Tensor, slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
    block_size: int, compress_ratio: int, dcp_world_size: int, cp_interleave: int,
) -> None:
    """compressor_utils.py ``CompressedSlotMappingKernel``: the last token of every
    ``compress_ratio`` positions gets its compressed state's slot, every other token -1."""
    _compressed_slots(compressed_slot_mapping, slot_mapping, query_start_loc, seq_lens,
                      block_table, block_size, compress_ratio, dcp_world_size, cp_interleave)


def compressed_slot_mapping_no_dcp(
    compressed_slot_mapping: torch.Tensor, slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
    block_size: int, compress_ratio: int,
) -> None:
    """0.31.0's form: replay-aware (a PAD own slot gives PAD), no DCP arguments (the later
    kernel with ``dcp_world_size == cp_interleave == 1``, where its DCP map is the identity).
    Equal to the kernel wherever its int32 ``block * block_size`` does not overflow."""
    _compressed_slots(compressed_slot_mapping, slot_mapping, query_start_loc, seq_lens,
                      block_table, block_size, compress_ratio, 1, 1)


def compressed_slot_mapping_in_place(
    slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    block_table: torch.Tensor, block_size: int, compress_ratio: int,
) -> None:
    """0.30.0's form: one tensor, the output (pre-filled with -1 by its caller); no replay
    check (every ``ratio``-th position is valid), no DCP. Same int32 caveat as above."""
    _compressed_slots(slot_mapping, None, query_start_loc, seq_lens, block_table, block_size,
                      compress_ratio, 1, 1)


def _compressed_slots(
    out: torch.Tensor, own_slots: torch.Tensor | None, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int, compress_ratio: int,
    dcp_world_size: int, cp_interleave: int,
) -> None:
    """The kernel's per-token slots into ``out``; ``own_slots`` None: no replay check."""
    compressed_slot_mapping = out
    num_reqs = block_table.shape[0]
    if num_reqs == 0:
        return
    t = torch.arange(compressed_slot_mapping.shape[0], dtype=query_start_loc.dtype)
    mine = (t >= query_start_loc[0]) & (t < query_start_loc[num_reqs])
    req = _request_of(query_start_loc, num_reqs, t).clamp_(max=num_reqs - 1)
    pos = seq_lens[req] - query_start_loc[req + 1] + t
    valid = _tmod(pos + 1, compress_ratio) == 0
    if own_slots is not None:
        valid &= own_slots[: t.shape[0]] != _PAD
    local = pos  # the DCP formula below is the identity for dcp_world_size == 1
    if dcp_world_size > 1:
        local = _tdiv(pos, cp_interleave * dcp_world_size) * cp_interleave + _tmod(
            pos, cp_interleave)
    state = _tdiv(local, compress_ratio)
    col = _tdiv(state, block_size).clamp_(0, block_table.shape[1] - 1)
    slots = block_table[req, col].long() * block_size + _tmod(state, block_size)
    new = torch.where(mine, torch.where(valid, slots, _PAD), compressed_slot_mapping)
    compressed_slot_mapping.copy_(new)


def build_prefill_chunk_metadata(
    query_start_loc: torch.Tensor, uncompressed_seq_lens: torch.Tensor,
    cu_compressed_seq_lens: torch.Tensor, row_start_cu_compressed_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor, cu_compressed_seq_len_ks: torch.Tensor,
    cu_compressed_seq_len_ke: torch.Tensor, query_slice_start: int, query_slice_stop: int,
    DCP_RANK: int, DCP_WORLD: int, DCP_INTERLEAVE: int, *, num_reqs: int, COMPRESS_RATIO: int,
) -> None:
    """indexer.py ``BuildPrefillChunkMetadataKernel``: per query token of the slice, the
    [ks, ke) row of compressed keys it sees; per compressed key, its request."""
    out = torch.arange(cu_compressed_seq_len_ks.shape[0], dtype=query_start_loc.dtype)
    tok = out + query_slice_start
    mine = (tok >= query_start_loc[0]) & (tok < query_start_loc[num_reqs]) & (
        tok < query_slice_stop
    )
    req = _request_of(query_start_loc, num_reqs, tok).clamp_(max=num_reqs - 1)
    row_start = row_start_cu_compressed_seq_lens[req]
    ctx = uncompressed_seq_lens[req] - query_start_loc[req + 1] + tok + 1
    per_token = _tdiv(ctx, COMPRESS_RATIO)
    if DCP_WORLD > 1:
        base = _tdiv(_tdiv(per_token, DCP_INTERLEAVE), DCP_WORLD) * DCP_INTERLEAVE
        rest = (per_token - base * DCP_WORLD - DCP_RANK * DCP_INTERLEAVE).clamp(0, DCP_INTERLEAVE)
        per_token = base + rest
    cu_compressed_seq_len_ks[mine] = row_start[mine].to(cu_compressed_seq_len_ks.dtype)
    cu_compressed_seq_len_ke[mine] = (row_start + per_token)[mine].to(
        cu_compressed_seq_len_ke.dtype
    )
    cu = cu_compressed_seq_lens
    k = torch.arange(token_to_seq.shape[0], dtype=cu.dtype)
    owned = (k >= cu[0]) & (k < cu[num_reqs])
    token_to_seq[owned] = _request_of(cu, num_reqs, k)[owned].to(token_to_seq.dtype)


def build_c128a_topk_metadata(
    global_decode_buffer: torch.Tensor, decode_lens_buffer: torch.Tensor,
    prefill_buffer: torch.Tensor, positions: torch.Tensor, compress_ratio: int,
    max_compressed_tokens: int, num_decode_tokens: int, token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor, block_size: int, slot_mapping: torch.Tensor,
) -> None:
    """deepseek_v4/sparse_mla.py ``BuildC128ATopkMetadataKernel``: decode tokens get the global
    slots of all their compressed states and a count; prefill tokens get local 0..n-1."""
    nd, width = num_decode_tokens, max_compressed_tokens
    n = torch.clamp(_tdiv(positions + 1, compress_ratio), max=width)
    offset = torch.arange(width)
    seen = offset[None, :] < n[:, None]
    if nd > 0:
        req = token_to_req_indices[:nd].long().clamp(0, block_table.shape[0] - 1)
        col = _tdiv(offset, block_size).clamp(max=block_table.shape[1] - 1)
        slots = block_table[req[:, None], col[None, :]] * block_size + _tmod(offset, block_size)
        _rows(global_decode_buffer, nd, width)[:] = torch.where(seen[:nd], slots, _PAD)
        count = n[:nd].clamp(min=0)
        decode_lens_buffer[:nd] = torch.where(slot_mapping[:nd] >= 0, count, 0)
    local = torch.where(seen[nd:], offset[None, :], _PAD)
    _rows(prefill_buffer, positions.shape[0] - nd, width)[:] = local
