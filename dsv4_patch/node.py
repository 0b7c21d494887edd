"""What this node is (platform, compute capability, attention backend) and what
``kv_cache_dtype`` becomes on it, decided before an engine is built.

``probe_node`` asks vLLM's platform layer (imported lazily); ``resolve_on_node`` asks
the installed vLLM's own attention-class selector (``dsv4_patch.selector``) for the
layout, then resolves the dtype with the pure ``rules``. The planner, without vLLM,
predicts the same from ``rules.detect_layout``'s per-release tables.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from dsv4_patch import rules
from dsv4_patch.selector import installed_layout, installed_version

logger = logging.getLogger("dsv4_patch")

ATTENTION_BACKEND_ENV = "VLLM_ATTENTION_BACKEND"


@dataclass(frozen=True)
class NodeInfo:
    """The facts that pick a DeepSeek-V4 KV layout on one node.

    ``source`` says where the capability came from: ``probe`` (vLLM's platform),
    ``nvml`` (the replica actor holds no GPU itself) or ``declared`` (config).
    """

    platform: str
    capability: tuple[int, int] | None
    attention_backend: str | None
    source: str = "probe"

    def as_dict(self) -> dict[str, Any]:
        cap = None if self.capability is None else f"{self.capability[0]}.{self.capability[1]}"
        return {
            "platform": self.platform,
            "compute_capability": cap,
            "attention_backend": self.attention_backend,
            "source": self.source,
        }


def attention_backend_of(engine_kwargs: dict[str, Any]) -> str | None:
    """The explicit attention backend in engine kwargs (either spelling), else the env."""
    backend = engine_kwargs.get("attention_backend")
    attention_config = engine_kwargs.get("attention_config")
    if backend is None and isinstance(attention_config, dict):
        backend = attention_config.get("backend")
    return backend or os.environ.get(ATTENTION_BACKEND_ENV) or None


def _nvml_capability() -> tuple[int, int] | None:
    """Capability of GPU 0 through NVML, which ignores CUDA_VISIBLE_DEVICES.

    A Ray Serve replica actor holds no GPU (its engine workers do), so CUDA in
    that process may see no device while NVML still sees the node's GPUs.
    """
    import pynvml  # shipped with vLLM's CUDA wheels

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        return int(major), int(minor)
    finally:
        pynvml.nvmlShutdown()


def platform_kind() -> str:
    """This machine's platform in our names (``rules.PLATFORMS``): ROCm is "rocm".

    vLLM's ``current_platform.device_type`` says "cuda" on ROCm too; everything that
    names the platform (the node probe, the patch record) should use this one name.
    """
    from vllm.platforms import current_platform

    if current_platform.is_rocm():
        return "rocm"
    return str(current_platform.device_type or "unknown")


def probe_node(
    attention_backend: str | None = None,
    declared_capability: tuple[int, int] | None = None,
) -> NodeInfo:
    """Read platform and capability from vLLM on this machine (no engine needed).

    ROCm reports device_type "cuda" in vLLM, so it is told apart explicitly. When
    CUDA sees no device here, NVML is asked; failing that, the declared
    capability is used and the fallback is logged.
    """
    from vllm.platforms import current_platform

    kind = platform_kind()
    backend = attention_backend or os.environ.get(ATTENTION_BACKEND_ENV) or None
    if kind != "cuda":
        return NodeInfo(kind, None, backend)
    cap = current_platform.get_device_capability()
    if cap is not None:
        return NodeInfo(kind, (int(cap.major), int(cap.minor)), backend)
    try:
        return NodeInfo(kind, _nvml_capability(), backend, "nvml")
    except Exception as exc:  # logged, and the declared value says what was used instead
        logger.warning(
            "dsv4: could not probe the compute capability (%s); using the declared "
            "node.compute_capability=%s",
            exc,
            declared_capability,
        )
        return NodeInfo(kind, declared_capability, backend, "declared")


@dataclass(frozen=True)
class NodeResolution:
    """The decisions behind the dtype the engine is built with (``resolution.engine_dtype``)."""

    decision: rules.LayoutDecision
    resolution: rules.Resolution

    def describe(self) -> str:
        """One log line saying what the requested dtype became and why."""
        res = self.resolution
        return (
            f"kv_cache_dtype={res.requested or 'auto'!r} -> engine {res.engine_dtype!r}, "
            f"workers store {res.cache_dtype_str!r} ({res.storage.value}) on layout "
            f"{self.decision.layout.value} via {self.decision.backend} "
            f"({self.decision.reason}): {res.reason}"
        )


def resolve_on_node(engine_kwargs: dict[str, Any], node: NodeInfo,
                 decision: rules.LayoutDecision | None = None) -> NodeResolution:
    """Resolve ``kv_cache_dtype`` for ``node``; never mutates ``engine_kwargs``.

    Only ``auto`` on fp8_ds_mla is rewritten (to ``fp8``): that is the one
    rewrite that is safe before the engine is built (docs/design.md, section 1).
    The layout is the installed vLLM's own decision unless ``decision`` is given
    (``table_decision``: the caller confirms it with ``layout_contradiction``).
    Raises ``rules.LayoutError`` / ``rules.KVCacheDtypeError`` with the fix.
    """
    if decision is None:
        decision = installed_layout(node.platform, node.capability, node.attention_backend)
    setup = rules.EngineSetup(installed_version(),
                              kv_cache_dtype=engine_kwargs.get("kv_cache_dtype"))
    return NodeResolution(decision, rules.build_v4_node(setup, decision).resolution)


def table_decision(node: NodeInfo) -> rules.LayoutDecision | None:
    """The installed release's layout from ``rules``' tables, where they leave no choice.

    On a CPU node every vLLM release has one DeepSeek-V4 attention class, fp8_ds_mla,
    and asking the installed vLLM means importing its DeepSeek-V4 model package (~1 s,
    before the engine process could start). There the table decides the dtype at once
    and ``layout_contradiction`` asks vLLM's own class while the engine boots; elsewhere
    (GPU selectors depend on capability and backend) None: ask vLLM first.
    """
    if node.platform.lower() != "cpu":
        return None
    version = installed_version()
    decision = rules.detect_layout("cpu", None, node.attention_backend, version)
    return rules.LayoutDecision(decision.layout, decision.backend,
                                f"{decision.reason} (vLLM {version}'s table; its own class "
                                "is checked while the engine starts)")


def layout_contradiction(node: NodeInfo, decided: rules.LayoutDecision) -> str | None:
    """None when the installed vLLM's own class stores ``decided``'s layout; else what it
    builds instead."""
    own = installed_layout(node.platform, node.capability, node.attention_backend)
    if own.layout is decided.layout:
        logger.info("dsv4: layout confirmed by the installed vLLM: %s", own.reason)
        return None
    return (f"the engine was started for {decided.layout.value} ({decided.reason}), but "
            f"{own.reason}")
