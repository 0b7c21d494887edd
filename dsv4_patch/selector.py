"""The installed vLLM's own choice of DeepSeek-V4 attention class, and so of KV layout.

vLLM decides the layout by the class it builds the attention layer with: on CUDA
``_select_dsv4_attn_cls`` (vllm/models/deepseek_v4/nvidia/model.py, 0.23+) maps the
configured backend and the device's compute capability to a class; ROCm, XPU and CPU
each have one class. The class carries its layout (``use_fp8_ds_mla_layout``; 0.23
``use_flashmla_fp8_layout``) and its backend, whose ``supports_compute_capability``
says where it runs. Asking that code keeps a replica right on whatever release it
runs (GPU replicas run 0.29, the CPU stack 0.32); ``rules.detect_layout``'s
per-release tables stay for planning where no vLLM is installed.

The selector reads only ``current_platform.get_device_capability()``; it is run with
the capability this node reports (or the one declared, for ``doctor --capability``)
by giving the function its own globals with a platform that answers just that.
Nothing of vLLM is changed. Documented and probed as the read ``layout.selector``.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from types import FunctionType, SimpleNamespace
from typing import Any

from dsv4_patch import rules
from dsv4_patch.patch import Read
from dsv4_patch.version import vllm_version

SELECTOR_MODULE = "vllm.models.deepseek_v4.nvidia.model"
SELECTOR = "_select_dsv4_attn_cls"
# The one DeepSeek-V4 attention class of the other platforms (vLLM 0.30+ for CPU).
PLATFORM_CLASS = {
    "cpu": ("vllm.models.deepseek_v4.cpu.cpu_sparse", "DeepseekV4CPUAttention"),
    "rocm": ("vllm.models.deepseek_v4.amd.rocm", "DeepseekV4ROCMAiterMLAAttention"),
    "xpu": ("vllm.models.deepseek_v4.xpu.xpu_sparse", "DeepseekV4XPUAttention"),
}
LAYOUT_FLAGS = ("use_fp8_ds_mla_layout", "use_flashmla_fp8_layout")  # 0.24+, 0.23


class Unavailable(LookupError):
    """The installed vLLM has no selector/class to ask (e.g. 0.20-0.22)."""


def installed_version() -> str:
    """The installed vLLM's release (``dsv4_patch.version``)."""
    return vllm_version()


class _NodePlatform:
    """``current_platform`` for the selector's one question: this node's capability."""

    def __init__(self, capability: Any):
        self._capability = capability

    def get_device_capability(self, device_id: int = 0) -> Any:
        return self._capability


def _device_capability(capability: tuple[int, int] | None) -> Any:
    if capability is None:
        return None
    from vllm.platforms.interface import DeviceCapability

    return DeviceCapability(*capability)


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise Unavailable(f"cannot import {module}: {exc}") from exc


def cuda_class(capability: tuple[int, int] | None, backend: str | None) -> Any:
    """The class the installed ``_select_dsv4_attn_cls`` picks for this capability/backend."""
    select = getattr(_import(SELECTOR_MODULE), SELECTOR, None)
    if not isinstance(select, FunctionType):
        raise Unavailable(f"{SELECTOR_MODULE} has no {SELECTOR}")
    enum = select.__globals__["AttentionBackendEnum"]
    if backend is not None and backend not in enum.__members__:
        raise rules.LayoutError(
            f"attention_backend={backend} is not an attention backend of vLLM "
            f"{installed_version()}; use {rules.FLASHINFER_DSV4} or "
            f"{rules.FLASHMLA_DSV4} (or leave it unset for the default).")
    run = FunctionType(select.__code__,
                       {**select.__globals__,
                        "current_platform": _NodePlatform(_device_capability(capability))},
                       select.__name__, select.__defaults__, select.__closure__)
    config = SimpleNamespace(attention_config=SimpleNamespace(
        backend=enum[backend] if backend else None))
    try:
        return run(config)
    except ValueError as exc:  # the selector's own refusal, e.g. a non-DSv4 FlashInfer
        raise rules.LayoutError(f"attention_backend={backend}: vLLM {installed_version()} "
                                f"refuses it: {exc}") from exc


def platform_class(kind: str) -> Any:
    module, name = PLATFORM_CLASS[kind]
    cls = getattr(_import(module), name, None)
    if cls is None:
        raise Unavailable(f"{module} has no {name}")
    return cls


def is_packed(cls: type) -> bool:
    """The class's layout flag: True = fp8_ds_mla, False = plain rows."""
    for flag in LAYOUT_FLAGS:
        if hasattr(cls, flag):
            return bool(getattr(cls, flag))
    raise Unavailable(f"{cls.__name__} has none of {', '.join(LAYOUT_FLAGS)}")


def installed_layout(platform: str, capability: tuple[int, int] | None = None,
                     attention_backend: str | None = None) -> rules.LayoutDecision:
    """What the installed vLLM builds DeepSeek-V4's attention with on this node.

    Where the installed vLLM has nothing to ask (``Unavailable``), the table of its
    release decides (``rules.detect_layout``), and the reason says so.
    """
    kind = platform.lower()
    backend = attention_backend.upper() if attention_backend else None
    if kind not in rules.PLATFORMS:
        return rules.detect_layout(kind, capability, backend)  # raises, naming the fix
    version = installed_version()
    try:
        cls: Any = cuda_class(capability, backend) if kind == "cuda" else platform_class(kind)
        packed = is_packed(cls)
    except Unavailable as exc:
        decision = rules.detect_layout(kind, capability, backend, version)
        return replace(decision, reason=f"{decision.reason} (vLLM {version}'s table: {exc})")
    name = cls.backend_cls.get_name()
    where = _capability_problem(cls, capability)
    if where:
        raise rules.LayoutError(f"attention_backend={backend or 'default'} gives {name} "
                                f"({cls.__name__}), which {where}; set attention_backend to "
                                "one this GPU supports, or unset it.")
    layout = rules.Layout.FP8_DS_MLA if packed else rules.Layout.PLAIN_ROWS
    return rules.LayoutDecision(layout, name if kind == "cuda" else f"{kind}-dsv4",
                                f"vLLM {version} builds {cls.__name__} ({name}), which "
                                f"stores {layout.value}")


def _capability_problem(cls: Any, capability: tuple[int, int] | None) -> str | None:
    if capability is None:
        return None
    if cls.backend_cls.supports_compute_capability(_device_capability(capability)):
        return None
    return f"does not support compute capability {capability[0]}.{capability[1]}"


def _probe() -> str | None:
    """What the installed vLLM lacks of what ``installed_layout`` reads (None: all there)."""
    from vllm.platforms import current_platform

    try:
        if current_platform.is_cpu():
            cls = platform_class("cpu")
        elif current_platform.is_rocm():
            cls = platform_class("rocm")
        elif current_platform.is_xpu():
            cls = platform_class("xpu")
        else:
            cls = cuda_class(None, None)
        is_packed(cls)
        cls.backend_cls.get_name()
    except (Unavailable, AttributeError) as exc:
        return f"{exc}; the release table decides instead"
    return None


READ = Read(
    name="layout.selector",
    module=SELECTOR_MODULE,
    target=f"{SELECTOR_MODULE}:{SELECTOR} (CUDA); the platform's DeepSeek-V4 attention class "
           "(cpu/amd/xpu); <class>.use_fp8_ds_mla_layout, .backend_cls.get_name(), "
           ".backend_cls.supports_compute_capability",
    why="the KV layout (fp8_ds_mla or plain rows) follows the attention class vLLM picks; "
        "the replica must predict it before the engine is built and on the release it runs "
        "(GPU 0.29, CPU 0.32), not from a copy of one release's rules",
    how="call the installed selector with a stand-in config holding only the attention "
        "backend, under its own globals with a platform that reports this node's "
        "capability; read the chosen class's layout flag and backend; nothing is changed. "
        "Missing (0.20-0.22, or a moved symbol): rules.detect_layout's table for the "
        "installed release decides, and the reason says so",
    upstream="no public API for the DeepSeek-V4 attention class or its KV layout per config "
             "(the selector is private, vLLM 0.23+)",
    affected="vLLM 0.23.0-0.33.0 (0.20-0.22: no selector, FlashMLA only; CPU class 0.30+)",
    remove_when="vLLM exposes the DeepSeek-V4 KV layout for a config publicly",
    probe=_probe,
)
