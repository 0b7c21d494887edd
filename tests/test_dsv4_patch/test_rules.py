"""Table tests of the pure rules: every requested dtype on every layout, layouts, bytes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dsv4_patch import rules
from dsv4_patch.rules import KVCacheDtypeError, Layout, LayoutError, Storage
from dsv4_patch.rules.dtypes import resolve_kv_cache_dtype
from tests.support.rule_contracts import engine_resolver_result

# The published configs, vendored in configs/models/ (copies of ../shared/reference/models).
MODELS = Path(__file__).resolve().parents[2] / "configs" / "models" / "deepseek-ai"
PACKED, ROWS = Layout.FP8_DS_MLA, Layout.PLAIN_ROWS

# (layout, requested) -> (engine_dtype, cache_dtype_str, storage) or the error fragment.
RESOLUTIONS = [
    (PACKED, "auto", ("fp8", "fp8_ds_mla", Storage.FP8_DS_MLA)),
    (PACKED, None, ("fp8", "fp8_ds_mla", Storage.FP8_DS_MLA)),
    (PACKED, "fp8", ("fp8", "fp8_ds_mla", Storage.FP8_DS_MLA)),
    (PACKED, "fp8_e4m3", ("fp8_e4m3", "fp8_ds_mla", Storage.FP8_DS_MLA)),
    (PACKED, "fp8_ds_mla", ("fp8_ds_mla", "fp8_ds_mla", Storage.FP8_DS_MLA)),
    (PACKED, "FP8", ("fp8", "fp8_ds_mla", Storage.FP8_DS_MLA)),
    (PACKED, "bfloat16", "kv_cache_dtype='bfloat16' cannot be stored on the fp8_ds_mla"),
    (PACKED, "float16", "kv_cache_dtype='float16' cannot be stored on the fp8_ds_mla"),
    (PACKED, "fp8_e5m2", ("fp8_e5m2", "fp8_ds_mla", Storage.FP8_DS_MLA)),  # as upstream 0.30+
    (PACKED, "fp8_inc", ("fp8_inc", "fp8_ds_mla", Storage.FP8_DS_MLA)),
    (PACKED, "", "kv_cache_dtype='' cannot be stored on the fp8_ds_mla"),
    (PACKED, "int8", "kv_cache_dtype='int8' cannot be stored on the fp8_ds_mla"),
    (ROWS, "auto", ("auto", "auto", Storage.BF16_ROWS)),
    (ROWS, None, ("auto", "auto", Storage.BF16_ROWS)),
    (ROWS, "bfloat16", ("bfloat16", "bfloat16", Storage.BF16_ROWS)),
    (ROWS, "fp8", ("fp8", "fp8", Storage.FP8_ROWS)),
    (ROWS, "fp8_e4m3", ("fp8_e4m3", "fp8_e4m3", Storage.FP8_ROWS)),
    (ROWS, "fp8_ds_mla", "unset attention_backend for fp8_ds_mla"),
    (ROWS, "float16", "kv_cache_dtype='float16' is not supported by the plain-row"),
    (ROWS, "fp8_e5m2", "kv_cache_dtype='fp8_e5m2' is not supported by the plain-row"),
    (ROWS, "int8", "set kv_cache_dtype: auto (bf16 rows) or fp8 (fp8 rows)"),
]


@pytest.mark.parametrize(("layout", "requested", "expected"), RESOLUTIONS)
def test_resolution_table(layout: Layout, requested: str | None, expected: object) -> None:
    if isinstance(expected, str):
        with pytest.raises(KVCacheDtypeError, match=re.escape(expected)):
            resolve_kv_cache_dtype(layout, requested)
        return
    res = resolve_kv_cache_dtype(layout, requested)
    assert (res.engine_dtype, res.cache_dtype_str, res.storage) == expected
    assert res.layout is layout and res.reason


def test_packed_error_names_value_layout_why_and_both_fixes() -> None:
    with pytest.raises(KVCacheDtypeError) as info:
        resolve_kv_cache_dtype(PACKED, "bfloat16")
    text = str(info.value)
    for fragment in (
        "'bfloat16'",
        "fp8_ds_mla KV layout",
        "448 B NoPE + 128 B bf16 RoPE + 8 B scales",
        "kv_cache_dtype: auto (or fp8)",
        "FLASHINFER_MLA_SPARSE_DSV4 on SM100",
    ):
        assert fragment in text


def test_auto_is_reported_as_changed_and_explicit_fp8_is_not() -> None:
    assert resolve_kv_cache_dtype(PACKED, "auto").changed
    assert not resolve_kv_cache_dtype(PACKED, "fp8").changed
    assert not resolve_kv_cache_dtype(ROWS, "auto").changed


LAYOUTS = [
    ("cuda", (9, 0), None, PACKED, "FLASHMLA_SPARSE_DSV4"),
    ("cuda", (10, 0), None, PACKED, "FLASHMLA_SPARSE_DSV4"),
    ("cuda", (12, 0), None, PACKED, "FLASHINFER_MLA_SPARSE_DSV4"),
    ("cuda", (10, 0), "FLASHINFER_MLA_SPARSE_DSV4", ROWS, "FLASHINFER_MLA_SPARSE_DSV4"),
    ("cuda", (12, 0), "flashinfer_mla_sparse_dsv4", PACKED, "FLASHINFER_MLA_SPARSE_DSV4"),
    ("cuda", (9, 0), "FLASHMLA_SPARSE", PACKED, "FLASHMLA_SPARSE_DSV4"),
    ("cuda", None, None, PACKED, "FLASHMLA_SPARSE_DSV4"),
    ("rocm", (9, 4), None, PACKED, "rocm-dsv4"),
    ("xpu", None, None, PACKED, "xpu-dsv4"),
    ("cpu", None, "FLASHINFER_MLA_SPARSE_DSV4", PACKED, "cpu-dsv4"),
]


@pytest.mark.parametrize(("platform", "cap", "backend", "layout", "chosen"), LAYOUTS)
def test_layout_follows_vllm_selection(
    platform: str, cap: tuple[int, int] | None, backend: str | None, layout: Layout, chosen: str
) -> None:
    decision = rules.detect_layout(platform, cap, backend)
    assert (decision.layout, decision.backend) == (layout, chosen)


@pytest.mark.parametrize(
    ("platform", "cap", "backend", "fragment"),
    [
        ("tpu", None, None, "platform='tpu' is not one of"),
        ("cuda", (9, 0), "FLASHINFER_MLA_SPARSE_DSV4", "supports compute capability 10.x and 12.x"),
        ("cuda", (12, 0), "FLASHINFER_MLA_SPARSE_SM120", "is not a DeepSeek-V4 backend"),
    ],
)
def test_layout_errors_name_the_fix(
    platform: str, cap: tuple[int, int] | None, backend: str | None, fragment: str
) -> None:
    with pytest.raises(LayoutError, match=fragment):
        rules.detect_layout(platform, cap, backend)


@pytest.mark.parametrize(
    ("version", "requested", "crashes"),
    [
        ("0.19.1", "auto", False),
        ("0.20.0", "auto", True),
        ("0.29.0", "auto", True),
        ("0.29.0", None, True),
        ("0.29.0", "fp8", False),
        ("0.30.0", "auto", False),
        ("0.33.0rc1", "auto", False),
    ],
)
def test_stock_vllm_crash_versions(version: str, requested: str | None, crashes: bool) -> None:
    assert rules.stock_vllm_crashes_on(version, PACKED, requested) is crashes
    assert rules.stock_vllm_crashes_on(version, ROWS, requested) is False


def test_engine_resolver_contract() -> None:
    assert engine_resolver_result(True, "auto") == ("fp8_ds_mla", "uint8")
    assert engine_resolver_result(False, "fp8") == ("fp8", "float8_e4m3fn")
    assert engine_resolver_result(False, "auto") == ("auto", "bfloat16")


def _shape(model: str) -> rules.ModelShape:
    path = MODELS / f"DeepSeek-V4-{model}" / "config.json"
    return rules.ModelShape.from_hf_config(json.loads(path.read_text()))


@pytest.mark.parametrize(
    ("model", "c4", "c128", "packed", "bf16", "fp8"),
    [("Flash", 21, 20, 3915, 6250, 3482), ("Pro", 30, 31, 5609.25, 8948, 4984)],
)
def test_bytes_per_token_of_real_configs(
    model: str, c4: int, c128: int, packed: float, bf16: float, fp8: float
) -> None:
    shape = _shape(model)
    assert (shape.layers_with_ratio(4), shape.layers_with_ratio(128)) == (c4, c128)
    assert rules.kv_bytes_per_token(shape, Storage.FP8_DS_MLA) == packed
    assert rules.kv_bytes_per_token(shape, Storage.BF16_ROWS) == bf16
    assert rules.kv_bytes_per_token(shape, Storage.FP8_ROWS) == fp8


def test_fp8_ds_mla_record_and_pages() -> None:
    shape = _shape("Flash")
    assert rules.state_bytes(shape, Storage.FP8_DS_MLA) == 584
    assert rules.state_bytes(shape, Storage.BF16_ROWS) == 1024
    assert rules.state_bytes(shape, Storage.FP8_ROWS) == 512
    c4, c128 = rules.page_breakdown(shape, Storage.FP8_DS_MLA)
    assert (c4.main_page_bytes, c4.indexer_page_bytes) == (37440, 8640)  # 64 x 584 -> 65 x 576
    assert c128.main_page_bytes == 1728 and c128.indexer_page_bytes == 0
    for row in (c4, c128):
        assert row.main_page_bytes % 576 == 0


def test_model_shape_rejects_short_ratio_list() -> None:
    cfg = {
        "num_hidden_layers": 4,
        "compress_ratios": [0, 4],
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "index_head_dim": 128,
    }
    with pytest.raises(ValueError, match="compress_ratios has 2 entries for num_hidden_layers=4"):
        rules.ModelShape.from_hf_config(cfg)


@pytest.mark.parametrize("value", [v for v in rules.PROBE_DTYPES if isinstance(v, str)])
def test_packed_rules_decide_like_the_fixed_upstream_resolver(value: str) -> None:
    """The replica's decision on fp8_ds_mla is upstream 0.30+'s for the value the engine
    gets (config strips and lower-cases it; auto is handed over as fp8): same stored
    dtype, or a refusal where upstream raises."""
    engine = value.strip().lower()
    upstream = rules.upstream_resolver_decision(True, engine)
    if upstream.error is not None:
        with pytest.raises(KVCacheDtypeError, match="Fix: set kv_cache_dtype: auto"):
            resolve_kv_cache_dtype(PACKED, value)
        return
    res = resolve_kv_cache_dtype(PACKED, value)
    assert res.cache_dtype_str == upstream.cache_dtype_str == "fp8_ds_mla"
    assert rules.upstream_resolver_decision(True, res.engine_dtype) == upstream
