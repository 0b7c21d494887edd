"""``AfterEngineSpawn``: jobs that start once this process has a child (the engine
core), or after the wait; vLLM's own layout answer and the heap freeze among them."""

from __future__ import annotations

import gc
import textwrap

import pytest

from deployments.serving.engine_wait import AfterEngineSpawn, freeze_heap
from dsv4_patch import rules
from dsv4_patch.node import NodeInfo, layout_contradiction
from tests.support.fresh_process import run_script

CPU = NodeInfo("cpu", None, None)

WAITS = textwrap.dedent("""
    import json, subprocess, sys, time
    from deployments.serving.engine_wait import AfterEngineSpawn
    from dsv4_patch.node import NodeInfo, layout_contradiction, table_decision
    node = NodeInfo("cpu", None, None)
    decided = table_decision(node)
    jobs = AfterEngineSpawn(wait_s=60)
    check = jobs.submit("the layout check", lambda: layout_contradiction(node, decided))
    jobs.close()
    time.sleep(1.0)
    ran_before_child = check.done()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        got = check.result(timeout=60)
        spawned = jobs.spawned.result()
    finally:
        child.kill()
    print("RESULT " + json.dumps({"ran_before_child": ran_before_child, "got": got,
                                  "spawned": spawned}))
""")


def test_jobs_wait_for_a_child_then_vllm_confirms_the_table() -> None:
    """In a fresh process (a test runner has children of its own): nothing runs until
    the process has a child, then vLLM's own class confirms the table's layout."""
    result, _ = run_script(WAITS, timeout_s=120)
    assert result == {
        "ran_before_child": False, "got": None, "spawned": True}


def test_without_a_child_jobs_run_after_the_wait_and_a_contradiction_is_named() -> None:
    wrong = rules.LayoutDecision(rules.Layout.PLAIN_ROWS, "cpu-dsv4", "a wrong table")
    jobs = AfterEngineSpawn(wait_s=0.2)
    check = jobs.submit("the layout check", lambda: layout_contradiction(CPU, wrong))
    jobs.close()
    problem = check.result(timeout=60)
    assert problem is not None and "DeepseekV4CPUAttention" in problem


def test_a_failing_job_is_logged_and_kept_in_its_future(
        caplog: pytest.LogCaptureFixture) -> None:
    jobs = AfterEngineSpawn(wait_s=0)
    nowhere = NodeInfo("nope", None, None)
    check = jobs.submit("the layout check", lambda: layout_contradiction(
        nowhere, rules.LayoutDecision(rules.Layout.FP8_DS_MLA, "x", "y")))
    jobs.close()
    with pytest.raises(rules.LayoutError, match="platform='nope'"):
        check.result(timeout=60)
    assert "the layout check, run while the engine started, failed" in caplog.text


def test_the_heap_freeze_leaves_the_lifespan_little_to_collect() -> None:
    try:
        assert freeze_heap() == gc.get_freeze_count() > 0
        assert len(gc.get_objects()) < gc.get_freeze_count()  # all but what came since
    finally:
        gc.unfreeze()
