"""kv_cache_dtype resolution on each layout, exactly as the fixed upstream resolver decides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4_patch.rules.layouts import (
    AUTO_VALUES,
    FLASHINFER_DSV4,
    FP8_ALIASES,
    KVCacheDtypeError,
    Layout,
    Storage,
)
from dsv4_patch.rules.versions import ASSERTING_RESOLVER, parse_version


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
    ``deployments/config/`` hands it over). fp8_ds_mla: exactly the fixed upstream
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
