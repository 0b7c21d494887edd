"""The registry of every touch dsv4_patch makes to vLLM internals (besides cpu_compat).

Each patch is documented in its ``PatchSpec`` (target symbol, why, how, upstream
PR/issue, affected versions, when to delete it), in the style of
``vllm_ascend/patch/__init__.py``. Patches are installed lazily: a post-import
hook fires when vLLM itself imports the target module, so processes that never
build a DeepSeek-V4 layer pay nothing. Each patch first *probes* the installed
symbol and changes it only where it is broken, so a fixed vLLM is left alone.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from dsv4_patch import rules
from dsv4_patch.import_hooks import when_imported
from dsv4_patch.record import PatchRecord, PatchResult

logger = logging.getLogger("dsv4_patch")

PATCHED_MARK = "__dsv4_patch__"


@dataclass(frozen=True)
class PatchSpec:
    """Documentation and entry point of one patch."""

    name: str
    module: str
    target: str
    why: str
    how: str
    upstream: str
    affected: str
    remove_when: str
    apply: Callable[[ModuleType], PatchResult]


# ------------------------------------------------------------------ resolver

RESOLVER_MODULE = "vllm.models.deepseek_v4.attention"
RESOLVER_NAME = "_resolve_dsv4_kv_cache_dtype"


def probe_resolver(resolver: Callable[..., Any]) -> str | None:
    """Return None when ``resolver`` maps ``auto`` to fp8_ds_mla, else the failure text."""
    try:
        cache_dtype, _ = resolver(True, "auto", None)
    except (AssertionError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if cache_dtype != "fp8_ds_mla":
        return f"auto resolved to {cache_dtype!r}, expected 'fp8_ds_mla'"
    return None


def make_resolver(original: Callable[..., Any]) -> Callable[..., Any]:
    """Build the replacement resolver around ``original``.

    fp8_ds_mla layout: decided by ``rules.engine_resolver_result`` (auto and the
    fp8 aliases -> fp8_ds_mla, written back onto ``cache_config`` so the page
    specs pick the 576 B slot; anything else -> KVCacheDtypeError naming the fix).
    Plain rows: the installed vLLM's own code, unchanged.
    """
    import torch  # vLLM is importing us from its attention module: torch is loaded.

    @functools.wraps(original)
    def resolve(
        use_fp8_ds_mla_layout: bool, kv_cache_dtype: str, cache_config: Any = None, *args: Any
    ) -> tuple[str, Any]:
        if not use_fp8_ds_mla_layout:
            return original(use_fp8_ds_mla_layout, kv_cache_dtype, cache_config, *args)
        cache_dtype, torch_name = rules.engine_resolver_result(True, kv_cache_dtype)
        if cache_config is not None and cache_config.cache_dtype != cache_dtype:
            logger.info(
                "dsv4_patch: kv_cache_dtype=%s on the fp8_ds_mla layout resolves to %s "
                "(written back to cache_config)",
                kv_cache_dtype,
                cache_dtype,
            )
            cache_config.cache_dtype = cache_dtype
        return cache_dtype, getattr(torch, torch_name)

    setattr(resolve, PATCHED_MARK, original)
    return resolve


def _rebind_everywhere(original: object, replacement: object, prefix: str) -> list[str]:
    """Point every module under ``prefix`` that holds ``original`` at ``replacement``.

    Catches ``from ...attention import _resolve_dsv4_kv_cache_dtype`` copies.
    """
    rebound = []
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)
                rebound.append(f"{name}.{attr}")
    return rebound


def apply_resolver_patch(module: ModuleType) -> PatchResult:
    """Replace ``_resolve_dsv4_kv_cache_dtype`` where it fails on ``auto``."""
    name = RESOLVER_PATCH.name
    original = getattr(module, RESOLVER_NAME, None)
    if original is None:
        return PatchResult(name, "skipped", f"{RESOLVER_MODULE}.{RESOLVER_NAME} not in this vLLM")
    if hasattr(original, PATCHED_MARK):
        return PatchResult(name, "applied", "already patched in this process")
    failure = probe_resolver(original)
    if failure is None:
        return PatchResult(name, "skipped", "installed resolver already maps auto -> fp8_ds_mla")
    replacement = make_resolver(original)
    sites = _rebind_everywhere(original, replacement, "vllm.models.deepseek_v4")
    return PatchResult(name, "applied", f"probe failed ({failure}); replaced {', '.join(sites)}")


RESOLVER_PATCH = PatchSpec(
    name="dsv4.resolve_kv_cache_dtype",
    module=RESOLVER_MODULE,
    target=f"{RESOLVER_MODULE}.{RESOLVER_NAME}",
    why=(
        "vLLM 0.20-0.29 assert kv_cache_dtype.startswith('fp8') on the fp8_ds_mla layout, "
        "so the default kv_cache_dtype='auto' crashes DeepSeek-V4 at layer construction."
    ),
    how=(
        "Post-import hook on the attention module; probe the resolver with 'auto'; if it "
        "fails, rebind the name (and every copy under vllm.models.deepseek_v4) to a wrapper "
        "that resolves auto/fp8/fp8_e4m3 -> fp8_ds_mla with cache_config write-back, "
        "rejects other dtypes with a clear error, and delegates plain rows to the original."
    ),
    upstream="vllm-project/vllm#47174 (bug), #45091 (fix), #55134 (duplicate fix, seed)",
    affected="vLLM 0.20.0-0.29.x and any later commit where the probe fails",
    remove_when="the oldest supported vLLM (Ray Serve LLM's pin) is >= 0.30",
    apply=apply_resolver_patch,
)


# ------------------------------------------------------------ SM120 validator

SM120_MODULE = "vllm.models.deepseek_v4.nvidia.flashinfer_sparse"
SM120_CLASS = "DeepseekV4FlashInferMLASparseBackend"


def _sm120_rejects_auto(backend: type) -> bool:
    """True when the SM120 validator refuses 'auto' for a dtype reason."""
    import torch
    from vllm.platforms.interface import DeviceCapability

    verdict = backend.supports_combination(
        512, torch.bfloat16, "auto", 256, True, True, True, False, DeviceCapability(12, 0)
    )
    return verdict is not None and "kv_cache_dtype" in verdict


def apply_sm120_validator_patch(module: ModuleType) -> PatchResult:
    """Let the SM120 DSv4 FlashInfer validator accept ``auto`` (it resolves to fp8)."""
    name = SM120_PATCH.name
    backend = getattr(module, SM120_CLASS, None)
    if backend is None or not hasattr(backend, "supports_combination"):
        return PatchResult(name, "skipped", f"{SM120_MODULE}.{SM120_CLASS} not in this vLLM")
    original = backend.supports_combination
    if hasattr(original, PATCHED_MARK):
        return PatchResult(name, "applied", "already patched in this process")
    if not _sm120_rejects_auto(backend):
        return PatchResult(name, "skipped", "SM120 validator already accepts auto")

    signature = inspect.signature(original.__func__)

    def supports_combination(cls: type, *args: Any, **kwargs: Any) -> str | None:
        bound = signature.bind(cls, *args, **kwargs)
        capability = bound.arguments.get("device_capability")
        if capability is not None and capability.major == 12:
            if bound.arguments.get("kv_cache_dtype") in rules.AUTO_VALUES:
                bound.arguments["kv_cache_dtype"] = "fp8"
        return original.__func__(*bound.args, **bound.kwargs)

    setattr(supports_combination, PATCHED_MARK, original)
    backend.supports_combination = classmethod(supports_combination)
    return PatchResult(name, "applied", "SM120 validator rejected auto; auto now checked as fp8")


SM120_PATCH = PatchSpec(
    name="dsv4.sm120_validator_accepts_auto",
    module=SM120_MODULE,
    target=f"{SM120_MODULE}.{SM120_CLASS}.supports_combination",
    why=(
        "On SM12x the DSv4 FlashInfer sparse backend stores fp8_ds_mla, yet its validator "
        "refuses kv_cache_dtype='auto', so the default config is rejected at backend selection."
    ),
    how="On capability 12.x, validate auto/None as fp8 (what the resolver turns them into).",
    upstream="vllm-project/vllm#55134 (relaxes the validator; closed as duplicate of #45091)",
    affected="vLLM 0.24.0-0.33.x (validator present and refusing auto)",
    remove_when="the validator accepts auto upstream (probe reports skipped)",
    apply=apply_sm120_validator_patch,
)

# ------------------------------------------------------- engine process lifetime

LIFETIME_MODULE = "vllm"  # imported in every process that loads the plugin
UPSTREAM_PARENT_MONITOR = "vllm.utils.system_utils.monitor_parent_death"


def upstream_parent_monitor() -> bool:
    """True when the installed vLLM's engine core watches its parent itself (#55846)."""
    module_name, _, attr = UPSTREAM_PARENT_MONITOR.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return False
    return hasattr(module, attr)


def apply_parent_watch(module: ModuleType) -> PatchResult:
    """Start ``lifetime.watch_parent`` in processes vLLM spawned (engine core, workers)."""
    from dsv4_patch import lifetime

    name = PARENT_WATCH.name
    if upstream_parent_monitor():
        return PatchResult(name, "skipped", f"vLLM has {UPSTREAM_PARENT_MONITOR}")
    parent = lifetime.watch_parent()
    if parent is None:
        return PatchResult(name, "skipped", "not started by multiprocessing: no owner to watch")
    return PatchResult(name, "applied", f"ends with its parent, process {parent}")


PARENT_WATCH = PatchSpec(
    name="dsv4.engine_dies_with_owner",
    module=LIFETIME_MODULE,
    target="vllm: the lifetime of the VLLM::EngineCore and VLLM::Worker processes",
    why=(
        "vLLM's engine core does not watch the process that spawned it: when a Serve "
        "replica dies without its shutdown (raylet/GCS killed, node lost, SIGKILL, OOM), "
        "its EngineCore and Workers live on under PID 1 with their memory and CPU."
    ),
    how=(
        "In a process multiprocessing spawned, a daemon thread waits on the parent "
        "sentinel; when the parent is gone it sends SIGTERM to its own process (vLLM's "
        "shutdown runs: requests aborted, workers stopped), SIGKILL after a grace period."
    ),
    upstream="vllm-project/vllm#55510 (bug), #55846 (death pipe for EngineCore, open), "
             "#34816 (PR_SET_PDEATHSIG, open)",
    affected="vLLM 0.20.0-0.33.x (no parent monitor in the engine core)",
    remove_when=f"{UPSTREAM_PARENT_MONITOR} (or an equivalent) exists in the oldest "
                "supported vLLM",
    apply=apply_parent_watch,
)

PATCHES: tuple[PatchSpec, ...] = (RESOLVER_PATCH, SM120_PATCH, PARENT_WATCH)


def install(record: PatchRecord, patches: tuple[PatchSpec, ...] = PATCHES) -> None:
    """Register every patch to apply when vLLM imports its target module.

    The record shows ``pending`` until then; a patch that raises propagates (a
    half-patched DeepSeek-V4 must not start silently).
    """
    for spec in patches:
        if record.status_of(spec.name) is not None:
            continue
        record.set(PatchResult(spec.name, "pending", f"waiting for import of {spec.module}"))
        when_imported(spec.module, functools.partial(_apply_and_record, spec, record))


def _apply_and_record(spec: PatchSpec, record: PatchRecord, module: ModuleType) -> None:
    result = spec.apply(module)
    record.set(result)
    logger.info("dsv4_patch: %s %s: %s", spec.name, result.status, result.reason)
