"""The differential matrix: the pure rules against each vLLM release's own decision code.

For every V4.1 release (0.30.0-0.34.0) x GPU (SM90, SM100, SM120, ROCm gfx942, gfx950)
x TP (1-16 where the heads divide) x ``block_size`` (unset, 64, 128, 256) x
``kv_cache_dtype`` (auto, fp8, fp8_ds_mla, nvfp4_ds_mla, fp8_e4m3, bfloat16) x LoRA x
model (V4.1-Flash, V4.1-Flash with DSpark, other head groups), plus explicit attention
backends and the MXFP4 indexer on a slice, ``tests/releases/differential.py`` runs the
wheel's own selection, resolver, record, spec and block-size code with the GPU stood in,
and ``rules.build`` must give the same backend, dtype, block, page bytes per layer group,
bytes per token and DSpark draft layers, or both refuse. A disagreement names the cell.
What is read from source rather than executed is pinned below by its text.
"""

from __future__ import annotations

import ast
import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest

from dsv4_patch import rules
from tests.releases import differential as diff
from tests.releases import sources as rs

REPO = Path(__file__).resolve().parents[2]
V41_FLASH = rules.flatten_config(json.loads(
    (REPO / "configs/models/deepseek-ai/DeepSeek-V4.1-Flash/config.json").read_text()))
MODELS: dict[str, dict[str, Any]] = {
    "v41-flash": V41_FLASH,
    "v41-flash-dspark": {**V41_FLASH, "num_nextn_predict_layers": 2},
    # 64 heads in 16 wo_a groups: 4 heads per group, mega never fits.
    "v41-o16": {**V41_FLASH, "o_groups": 16},
}
TPS = (1, 2, 4, 8, 16)
BLOCKS = (None, 64, 128, 256)
DTYPES = ("auto", "fp8", "fp8_ds_mla", "nvfp4_ds_mla", "fp8_e4m3", "bfloat16")
EXPLICIT = ("FLASHMLA_SPARSE_DSV41", "FLASHINFER_MLA_SPARSE_DSV41", "FLASHMLA_MEGA_ATTN_DSV41",
            "FLASHINFER_MLA_SPARSE", "ROCM_FLASHMLA_SPARSE_DSV41")


def cells() -> list[tuple[str, diff.Cell]]:
    out = []
    for model, tp, block, dtype, lora in itertools.product(MODELS, TPS, BLOCKS, DTYPES,
                                                           (False, True)):
        if MODELS[model]["num_attention_heads"] % tp == 0:
            out.append((model, diff.Cell(tp, block, dtype, lora)))
    for backend, dtype, lora, tp in itertools.product(EXPLICIT, DTYPES, (False, True), (1, 16)):
        out.append(("v41-flash", diff.Cell(tp, None, dtype, lora, backend)))
    for dtype, block, lora in itertools.product(("auto", "fp8", "bfloat16"), (None, 128, 256),
                                                (False, True)):
        out.append(("v41-flash", diff.Cell(1, block, dtype, lora, indexer_mxfp4=True)))
    return out


CELLS = cells()


def ours(version: str, gpu: str, model: str, cell: diff.Cell) -> diff.Outcome:
    platform, cap = diff.GPUS[gpu]
    setup = rules.EngineSetup(
        version, platform, cap, cell.tp, cell.block_size, cell.kv_cache_dtype,
        cell.backend, "mxfp4" if cell.indexer_mxfp4 else None, cell.lora,
        "dspark" if model.endswith("dspark") else None)
    try:
        built = rules.build(setup, MODELS[model])
    except (rules.LayoutError, rules.KVCacheDtypeError) as exc:
        return diff.Outcome(refused=str(exc))
    pages = tuple(sorted((k, v) for k, v in built.page_bytes.items()
                         if k.startswith(("main", "indexer"))))
    topo = rules.V41Topology.from_hf_config(MODELS[model])
    return diff.Outcome(built.backend, built.cache_dtype_str, built.block_size, pages,
                        built.bytes_per_token, topo.draft_layers)


def differences(version: str, gpu: str) -> list[str]:
    release = diff.release(version, gpu)
    found = []
    for model, cell in CELLS:
        theirs = release.run(cell, MODELS[model])
        mine = ours(version, gpu, model, cell)
        name = f"vLLM {version} {gpu} {model} {cell}"
        if (theirs.refused is None) != (mine.refused is None):
            found.append(f"{name}: vLLM {_said(theirs)}; rules {_said(mine)}")
            continue
        if theirs.refused is None:
            want = theirs if theirs.draft_layers >= 0 else \
                diff.Outcome(**{**theirs.__dict__, "draft_layers": mine.draft_layers})
            if want != mine:
                found.append(f"{name}: vLLM {want} vs rules {mine}")
    return found


def _said(outcome: diff.Outcome) -> str:
    return f"refuse ({outcome.refused})" if outcome.refused else f"build {outcome}"


@pytest.mark.parametrize("gpu", sorted(diff.GPUS))
@pytest.mark.parametrize("version", diff.V41_RELEASES)
def test_rules_agree_with_the_release_cell_by_cell(version: str, gpu: str) -> None:
    found = differences(version, gpu)
    assert not found, f"{len(found)} of {len(CELLS)} cells differ:\n" + "\n".join(found[:15])


# ------------------------------------------------------------ read from source, pinned


@pytest.mark.parametrize("version", diff.V41_RELEASES)
def test_page_padding_is_round_up_to_alignment(version: str) -> None:
    """The page arithmetic the harness mirrors (not executed: the spec classes need the
    release's torch dtypes end to end): ``_apply_alignment_padding`` rounds the real page
    up to the spec's ``alignment``."""
    node = diff.module_function(version, diff.KV_INTERFACE, "_apply_alignment_padding")
    assert node is not None
    text = ast.unparse(node)
    assert "round_up(actual_page_size, spec.alignment)" in text, text


@pytest.mark.parametrize("version", diff.V41_RELEASES)
def test_user_block_size_is_checked_per_backend(version: str) -> None:
    """``supports_block_size``: a user block must be a multiple of a kernel size of each
    backend (the harness refuses where any backend declines it)."""
    node = diff.lookup(version, "AttentionBackend", "supports_block_size")
    assert node is not None and "block_size % supported_size == 0" in ast.unparse(node)


@pytest.mark.parametrize("version", diff.V41_RELEASES)
def test_mxfp4_block_is_32(version: str) -> None:
    """``_indexer_k_cache_head_dim`` divides by MXFP4_BLOCK_SIZE (32 in every release)."""
    path = "vllm/models/deepseek_v4/common/ops/fused_indexer_q.py"
    if rs.has_file(version, path):
        assert diff.module_constant(version, path, "MXFP4_BLOCK_SIZE") == 32


def test_matrix_size() -> None:
    """The matrix covers what it says (a shrinking list would pass vacuously)."""
    assert len(CELLS) * len(diff.V41_RELEASES) * len(diff.GPUS) > 20000


@pytest.mark.parametrize("version", rs.RELEASES)
def test_v4_kernel_blocks_are_256(version: str) -> None:
    """DeepSeek-V4's sparse-MLA backends take 256-token blocks only (executed from the
    wheel): ``rules.build`` gives 256 and refuses a ``block_size`` that is no multiple."""
    paths = ("vllm/models/deepseek_v4/sparse_mla.py",
             "vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py")
    found = []
    for path in paths:
        if not rs.has_file(version, path):
            continue
        for node in ast.walk(ast.parse(rs.source(version, path))):
            if isinstance(node, ast.FunctionDef) and \
                    node.name == "get_supported_kernel_block_sizes":
                fn = diff.function(node, {"MultipleOf": diff.MultipleOf,
                                          "current_platform": None})
                found.append(fn())
    assert all(sizes == [256] for sizes in found), found
    hf = {**json.loads((REPO / "configs/models/deepseek-ai/DeepSeek-V4-Flash/config.json")
                       .read_text())}
    assert rules.build(rules.EngineSetup(version, "cuda", (9, 0)), hf).block_size == 256
    with pytest.raises(rules.LayoutError, match="block_size=128"):
        rules.build(rules.EngineSetup(version, "cuda", (9, 0), block_size=128), hf)


def test_kv_table_is_fresh() -> None:
    """docs/kv-table.md is what tests/releases/kvtable.py renders today."""
    from tests.releases import kvtable

    assert (REPO / "docs" / "kv-table.md").read_text() == kvtable.render(), (
        "docs/kv-table.md is stale. Fix: python -m tests.releases.kvtable docs/kv-table.md")


NIXL_PATHS = ("vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py",
              "vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py")


@pytest.mark.parametrize("version", rs.RELEASES)
def test_release_facts_are_the_wheels(version: str) -> None:
    """NIXL's connector version, CacheConfig's block and memory defaults, per wheel."""
    rel = rules.release_rules(version)
    path = next(p for p in NIXL_PATHS if rs.has_file(version, p))
    assert diff.module_constant(version, path, "NIXL_CONNECTOR_VERSION") == \
        rel.nixl_connector_version
    assert diff._cache_default_block(version) == rel.default_block_size
    text = rs.source(version, diff.CACHE)
    cls = rs._find(ast.parse(text), ast.ClassDef, "CacheConfig")
    field = diff.member(cls, "gpu_memory_utilization")
    default = ast.literal_eval(field.value.keywords[0].value)  # type: ignore[union-attr]  # ast.AST | None; the release's field has a Call value
    if default is None:  # 0.34: resolved_gpu_memory_utilization
        assert rel.extensible_kv_cache
        assert "return 1.0" in text and "DEFAULT_GPU_MEMORY_UTILIZATION: ClassVar[float] = 0.92" \
            in text
        assert rules.default_gpu_memory_utilization(version, "cuda") == 1.0
        assert rules.default_gpu_memory_utilization(version, "cpu") == 0.92
    else:
        assert default == rel.gpu_memory_utilization == 0.92


# ------------------------------------------------------------ DeepSeek-V4, 0.20.0-0.34.0

V4_MODELS = {name: json.loads((REPO / f"configs/models/deepseek-ai/{name}/config.json")
                              .read_text()) for name in ("DeepSeek-V4-Flash", "DeepSeek-V4-Pro")}
V4_BACKENDS = (None, "FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4",
               "FLASHINFER_MLA_SPARSE")
V4_CAPS = ((9, 0), (10, 0), (12, 0))


def _v4_release(version: str) -> tuple[Any, Any]:
    from tests.releases import selector as sel

    return sel.selection(version), rs.release(version, plugin=True).resolver()


def v4_differences(version: str) -> list[str]:
    """Each CUDA cell: the wheel's own selector and (dsv4_patch-patched) resolver against
    ``rules.build``: layout, backend, cache dtype, block, or both refuse. TP and LoRA are
    not read by V4's KV decisions (replicated KV; no ``lora_config`` in its selector)."""
    from dsv4_patch.patches.kv_dtype import call_resolver

    select, resolver = _v4_release(version)
    found = []
    for (model, hf), cap, backend, dtype, block in itertools.product(
            V4_MODELS.items(), V4_CAPS, V4_BACKENDS, DTYPES, (None, 128, 256)):
        chosen: tuple[str, ...] = ("fp8_ds_mla", rules.FLASHMLA_DSV4) if select is None \
            else select(cap, backend)  # 0.20-0.22: FlashMLA only, whatever the backend says
        theirs: tuple = ("refused",)
        if chosen != ("error",) and (block is None or block % 256 == 0):
            outcome = call_resolver(resolver, chosen[0] == "fp8_ds_mla", dtype)
            if outcome.error is None:
                theirs = (chosen[1], outcome.cache_dtype_str, block or 256)
        try:
            built = rules.build(rules.EngineSetup(version, "cuda", cap, block_size=block,
                                                  kv_cache_dtype=dtype,
                                                  attention_backend=backend), hf)
            mine: tuple = (built.backend, built.cache_dtype_str, built.block_size)
        except (rules.LayoutError, rules.KVCacheDtypeError):
            mine = ("refused",)
        # Stricter by design, named: 0.20-0.22 ignore FLASHINFER_MLA_SPARSE_DSV4
        # (test_selector); and on V4's plain rows the resolver keeps a ``*_ds_mla`` name
        # over bf16/e4m3 rows (the FlashInfer backend's validator, which refuses it, is
        # never called by V4's selector), so the specs would name a format nobody writes.
        if mine == ("refused",) and backend == rules.FLASHINFER_DSV4 and (
                select is None or (chosen[0] == "plain_rows" and dtype.endswith("_ds_mla"))):
            continue
        if theirs != mine:
            found.append(f"vLLM {version} sm{cap[0]}{cap[1]} {model} backend={backend} "
                         f"kv_cache_dtype={dtype} block_size={block}: vLLM {theirs}, "
                         f"rules {mine}")
    return found


@pytest.mark.parametrize("version", rs.RELEASES)
def test_v4_rules_agree_with_the_release_cell_by_cell(version: str) -> None:
    found = v4_differences(version)
    assert not found, f"{len(found)} cells differ:\n" + "\n".join(found[:15])


NIXL_WORKER = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py"


@pytest.mark.parametrize("version", rs.FIXED_RELEASES)
def test_nixl_region_dedup_is_the_wheels(version: str) -> None:
    """vllm#57661: ``register_kv_caches`` reuses a region when only the base address
    matches (0.30-0.33), or when base address and block length match (0.34)."""
    text = rs.source(version, NIXL_WORKER)
    by_base = re.search(r"if base_addr in seen_base_addresses\b", text) is not None
    by_base_and_len = "region_key = (base_addr, block_len)" in text
    assert by_base != by_base_and_len, version
    assert rules.release_rules(version).nixl_region_dedup_by_base is by_base
