"""The layout tables of ``rules.detect_layout`` against each release's real selector,
and the installed vLLM's own selector (``dsv4_patch.selector``) against its table.

Per release 0.20.0-0.33.0 (cached wheels, ``tests/releases/selector.py``): for every
compute capability x attention backend of the grid, the table says what that release's
``_select_dsv4_attn_cls`` and the chosen class say (layout and backend, or an error).
Two documented refusals of ours are stricter than a release: FLASHINFER_MLA_SPARSE_DSV4
on 0.20-0.22 (no selector: the layer is FlashMLA whatever the setting says, so the
setting would be ignored). Cannot prove: that the CUDA kernels behind each class run.
"""

from __future__ import annotations

import itertools

import pytest

from dsv4_patch import rules, selector
from dsv4_patch.rules.layouts import cuda_selector
from tests.releases import selector as sel
from tests.releases import sources as rs

GRID = list(itertools.product(sel.CAPABILITIES, sel.BACKENDS))


def table(version: str, capability: tuple[int, int] | None, backend: str | None) -> tuple:
    try:
        decision = rules.detect_layout("cuda", capability, backend, version)
    except rules.LayoutError:
        return ("error",)
    return (decision.layout.value, decision.backend)


@pytest.mark.parametrize("version", rs.RELEASES)
def test_the_table_is_what_the_release_selects(version: str) -> None:
    release = sel.selection(version)
    if release is None:  # 0.20-0.22: no selector, FlashMLA sparse only
        assert cuda_selector(version).flashinfer is False
        assert not any("FlashInfer" in name for name in sel.classes(version)), version
        for capability, backend in GRID:
            want = ("error",) if backend == rules.FLASHINFER_DSV4 else (
                "fp8_ds_mla", rules.FLASHMLA_DSV4)
            assert table(version, capability, backend) == want, (capability, backend)
        return
    differ = [(cap, backend, release(cap, backend), table(version, cap, backend))
              for cap, backend in GRID
              if release(cap, backend) != table(version, cap, backend)]
    assert differ == [], f"vLLM {version}: (capability, backend, release, table)"


@pytest.mark.parametrize("version", rs.RELEASES)
def test_each_release_s_cpu_rocm_xpu_class_is_what_the_table_says(version: str) -> None:
    """A CPU replica starts its engine on the table's layout (``node.table_decision``) and
    asks vLLM's own class while it boots: every release's class, read from its wheel,
    stores what the table says. A release without the file, or whose class has no layout
    flag (ROCm on 0.22), has nothing to ask: the installed selector falls back to the
    table there too (``selector.Unavailable``)."""
    for kind, (module, name) in selector.PLATFORM_CLASS.items():
        path = module.replace(".", "/") + ".py"
        if not rs.has_file(version, path):
            continue
        packed = sel.platform_layout_flag(version, path, name)
        if packed is None:
            continue
        table_layout = rules.detect_layout(kind, None, None, version).layout
        assert (rules.Layout.FP8_DS_MLA if packed else rules.Layout.PLAIN_ROWS) \
            is table_layout, (version, kind, name)


def test_the_cpu_class_exists_where_the_cpu_path_runs() -> None:
    """The per-release check above is not vacuous: vLLM's own CPU class is in every
    release from 0.30 (before it, the CPU path is dsv4_patch's and the table decides)."""
    path = selector.PLATFORM_CLASS["cpu"][0].replace(".", "/") + ".py"
    assert [v for v in rs.RELEASES if rs.has_file(v, path)] == \
        [v for v in rs.RELEASES if tuple(map(int, v.split("."))) >= (0, 30, 0)]


def test_the_gpu_default_is_the_ray_llm_pin() -> None:
    """Planning without a version plans for what a GPU replica runs (ray[llm] 2.60: 0.29)."""
    assert rules.DEFAULT_VLLM["cuda"] == "0.29.0"
    assert rules.detect_layout("cuda", (10, 0), rules.FLASHINFER_DSV4) == rules.detect_layout(
        "cuda", (10, 0), rules.FLASHINFER_DSV4, "0.29.0")


def test_the_installed_selector_agrees_with_its_release_table() -> None:
    """vLLM 0.32's own selector (installed here), run for each declared capability."""
    version = selector.installed_version()
    assert selector.READ.probe() is None
    for capability, backend in GRID:
        try:
            got = selector.installed_layout("cuda", capability, backend)
            asked: tuple[str | None, ...] = (got.layout.value, got.backend)
        except rules.LayoutError:
            asked = ("error",)
        assert asked == table(version, capability, backend), (capability, backend)
    cpu = selector.installed_layout("cpu", None, rules.FLASHINFER_DSV4)
    assert cpu.layout is rules.Layout.FP8_DS_MLA and "DeepseekV4CPUAttention" in cpu.reason
    with pytest.raises(rules.LayoutError, match=r"NOPE is not an attention backend.*unset"):
        selector.installed_layout("cuda", (9, 0), "nope")
