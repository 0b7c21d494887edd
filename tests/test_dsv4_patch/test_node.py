"""``dsv4_patch.node``: the layout decided ahead from the table on a CPU node, and the
installed vLLM's own class that confirms or contradicts it."""

from __future__ import annotations

from dsv4_patch import rules
from dsv4_patch.node import NodeInfo, layout_contradiction, resolve_on_node, table_decision

CPU = NodeInfo("cpu", None, None)


def test_a_cpu_node_is_decided_from_the_table_a_gpu_node_is_not() -> None:
    decided = table_decision(CPU)
    assert decided is not None and decided.layout is rules.Layout.FP8_DS_MLA
    assert "table" in decided.reason and "checked while the engine starts" in decided.reason
    assert table_decision(NodeInfo("cuda", (9, 0), None)) is None
    assert table_decision(NodeInfo("rocm", None, None)) is None


def test_the_table_decision_resolves_the_dtype_as_vllm_s_own_does() -> None:
    decided = table_decision(CPU)
    for requested in (None, "auto", "fp8", "fp8_ds_mla"):
        ahead = resolve_on_node({"kv_cache_dtype": requested}, CPU, decided).resolution
        asked = resolve_on_node({"kv_cache_dtype": requested}, CPU).resolution
        assert (ahead.engine_dtype, ahead.cache_dtype_str) == \
            (asked.engine_dtype, asked.cache_dtype_str), requested


def test_the_installed_vllm_confirms_the_table_and_names_a_contradiction() -> None:
    decided = table_decision(CPU)
    assert decided is not None
    assert layout_contradiction(CPU, decided) is None
    wrong = rules.LayoutDecision(rules.Layout.PLAIN_ROWS, "cpu-dsv4", "a wrong table")
    problem = layout_contradiction(CPU, wrong)
    assert problem is not None
    assert "started for plain_rows (a wrong table)" in problem
    assert "DeepseekV4CPUAttention" in problem and "fp8_ds_mla" in problem
