"""The byte formats the DeepSeek-V4 CPU ops read and write, and their number codecs.

The writers and readers of a host without the native kernels are all in ``kernels``, but
they follow the real kernels' byte layout, so pages vLLM allocates are never overrun:

* fp8_ds_mla (SWA and compressed main-attention caches), per block of ``bs`` tokens:
  ``[bs x 576 B: 448 fp8-e4m3 NoPE + 64 bf16 RoPE] [bs x 8 B: 7 UE8M0 scales + 1 pad]``,
  one UE8M0 (power-of-two) scale per 64 NoPE values; the block's row stride (page
  padded to a multiple of 576 B) is taken from the tensor, never assumed.
* indexer K cache, per block: ``[bs x 128 B fp8-e4m3] [bs x 4 B fp32 scale]``, one
  power-of-two scale for the whole 128-dim key.
* compressor state cache ``[num_blocks, bs, 2 * state_width]`` fp32: ``[kv | score+ape]``
  per token; with overlap (ratio 4) a row holds two heads and the window's last
  ``ratio`` entries read the second one.

The geometry constants come from ``dsv4_patch.rules`` (one place).
"""

from __future__ import annotations

import torch

from dsv4_patch.rules.byte_model import (
    FP8_DS_MLA_SCALE_BYTES,
    FP8_DS_MLA_TOKEN_DATA_BYTES,
    INDEX_HEAD_DIM,
    NOPE_DIM,
    UE8M0_GROUP,
)
from dsv4_patch.rules.byte_model import INDEXER_SCALE_BYTES as INDEX_SCALE_BYTES

# fp8_ds_mla record and indexer K cache geometry: one place, dsv4_patch.rules.
QUANT_BLOCK = UE8M0_GROUP
NUM_QUANT_BLOCKS = NOPE_DIM // QUANT_BLOCK
TOKEN_DATA_BYTES = FP8_DS_MLA_TOKEN_DATA_BYTES  # 576
SCALE_BYTES = FP8_DS_MLA_SCALE_BYTES  # 8: 7 UE8M0 exponents + 1 pad byte

FP8_MAX = 448.0
QUANT_EPS = 1e-4
FP8 = torch.float8_e4m3fn


def check(cond: bool, msg: str) -> None:
    """Raise like the C++ TORCH_CHECKs do: what was wrong and what is expected."""
    if not cond:
        raise RuntimeError(f"dsv4_patch.patches.cpu.kernels: {msg}")


def cos_sin(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """cos/sin rows for ``positions`` from a ``[max_pos, rot_dim]`` ``[cos | sin]`` table."""
    rows = cos_sin_cache.float()[positions.long()]
    half = rows.shape[-1] // 2
    return rows[..., :half], rows[..., half:]


def gptj_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of pairs ``(x[2i], x[2i+1])`` by angle i; fp32 out.

    ``inverse`` rotates by the negative angle, undoing a forward rotation.
    """
    x = x.float()
    even, odd = x[..., 0::2], x[..., 1::2]
    if inverse:
        sin = -sin
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 -> fp32 (round to nearest even), as the kernels do before quantizing."""
    return x.to(torch.bfloat16).float()


def quant_ue8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[N, 448]`` to fp8-e4m3 bytes with one UE8M0 scale per 64 values.

    Scale = 2^ceil(log2(max(amax / 448, 1e-4))), stored as the biased exponent byte
    (exponent + 127). Returns ``(fp8 bytes [N, 448] uint8, scale bytes [N, 7] uint8)``.
    """
    n = x.shape[0]
    tiles = x.float().reshape(n, NUM_QUANT_BLOCKS, QUANT_BLOCK)
    amax = tiles.abs().amax(dim=-1)
    exponent = torch.ceil(torch.log2(torch.clamp(amax / FP8_MAX, min=QUANT_EPS)))
    scaled = (tiles * torch.exp2(-exponent).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    fp8 = scaled.to(FP8).view(torch.uint8).reshape(n, NOPE_DIM)
    return fp8, (exponent + 127).to(torch.uint8)


def fp8_bytes_to_float(b: torch.Tensor) -> torch.Tensor:
    """fp8-e4m3fn bytes -> fp32, exactly, for every finite code (NaN codes are never
    written: values are clamped to +-448 before the cast).

    torch's fp8 -> fp32 cast is scalar on CPU (~10 ns/element); this is vectorized
    integer work: the 7 magnitude bits shifted to float32 bit 20 give value * 2^-120
    (normals and, via float32 subnormals, fp8 subnormals alike), the sign bit goes to
    bit 31, and one multiply by 2^120 restores the scale.
    """
    x = b.view(torch.uint8).to(torch.int32)
    bits = ((x & 0x7F) << 20) | ((x & 0x80) << 24)
    return bits.view(torch.float32) * 2.0**120


def dequant_ue8m0(fp8_bytes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quant_ue8m0`` for ``[..., 448]`` bytes and ``[..., >=7]`` scale bytes."""
    shape = fp8_bytes.shape[:-1]
    vals = fp8_bytes_to_float(fp8_bytes).reshape(*shape, NUM_QUANT_BLOCKS, QUANT_BLOCK)
    e = scale_bytes[..., :NUM_QUANT_BLOCKS].float()
    scale = torch.where(e == 0, torch.zeros_like(e), torch.exp2(e - 127.0))
    return (vals * scale.unsqueeze(-1)).reshape(*shape, NOPE_DIM)


def quant_pow2_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8-e4m3 with one power-of-two scale per row of ``x [..., D]``.

    Scale = 2^ceil(log2(max(amax, 1e-4) / 448)); returns ``(fp8 [..., D], scale [...])``.
    """
    x = x.float()
    amax = torch.clamp(x.abs().amax(dim=-1), min=QUANT_EPS)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def _paged_views(
    cache_2d: torch.Tensor, block_size: int, data_bytes: int, scale_bytes: int, what: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_blocks, bs, data_bytes]`` and ``[num_blocks, bs, scale_bytes]`` views of a
    2-D uint8 paged cache whose pages hold all tokens' data, then all their scales
    (any row stride: a page of a pooled allocation)."""
    check(cache_2d.dim() == 2 and cache_2d.dtype == torch.uint8,
           f"{what} cache must be a 2-D uint8 tensor, got {tuple(cache_2d.shape)} "
           f"{cache_2d.dtype}")
    need = block_size * (data_bytes + scale_bytes)
    check(block_size > 0 and cache_2d.shape[1] >= need,
           f"{what} page of {cache_2d.shape[1]} B cannot hold {block_size} tokens "
           f"({need} B needed): block_size does not match the allocated cache")
    nb = cache_2d.shape[0]
    data_end = block_size * data_bytes
    data = cache_2d[:, :data_end].view(nb, block_size, data_bytes)
    scales = cache_2d[:, data_end:need].view(nb, block_size, scale_bytes)
    return data, scales


def _mla_views(cache_2d: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-data (576 B) and scale (8 B) views of an fp8_ds_mla cache."""
    return _paged_views(cache_2d, block_size, TOKEN_DATA_BYTES, SCALE_BYTES, "fp8_ds_mla")


def write_mla_records(
    cache_2d: torch.Tensor, slots: torch.Tensor, block_size: int,
    nope: torch.Tensor, rope: torch.Tensor,
) -> None:
    """Quantize and store tokens into fp8_ds_mla records at flat ``slots`` (all >= 0).

    ``nope`` [N, 448] must already be bf16-rounded values; ``rope`` [N, 64] is stored
    as bf16.
    """
    if slots.numel() == 0:
        return
    data, scales = _mla_views(cache_2d, block_size)
    fp8, scale_b = quant_ue8m0(nope)
    rope_b = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    blk, pos = slots // block_size, slots % block_size
    check(int(blk.max()) < cache_2d.shape[0],
           f"slot {int(slots.max())} is past the cache ({cache_2d.shape[0]} blocks of "
           f"{block_size})")
    data[blk, pos] = torch.cat((fp8, rope_b), dim=-1)
    pad = torch.zeros((slots.shape[0], 1), dtype=torch.uint8, device=slots.device)
    scales[blk, pos] = torch.cat((scale_b, pad), dim=-1)


def read_mla_records(cache_2d: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Dequantized fp32 ``[..., 512]`` keys for flat ``slots`` (any shape, all valid)."""
    data, scales = _mla_views(cache_2d, block_size)
    blk, pos = slots // block_size, slots % block_size
    rec = data[blk, pos]
    nope = dequant_ue8m0(rec[..., :NOPE_DIM], scales[blk, pos])
    rope = rec[..., NOPE_DIM:].contiguous().view(torch.bfloat16).float()
    return torch.cat((nope, rope), dim=-1)


def indexer_views(cache_2d: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key (128 B) and scale-byte (4 B) views of an indexer cache."""
    return _paged_views(cache_2d, block_size, INDEX_HEAD_DIM, INDEX_SCALE_BYTES, "indexer")
