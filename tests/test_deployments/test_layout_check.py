"""``DeferredLayoutCheck``: vLLM's own layout answer, asked once this process has a
child (the engine core), or after its wait; a contradiction comes back to the replica."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deployments.serving.layout_check import DeferredLayoutCheck
from dsv4_patch import rules
from dsv4_patch.node import NodeInfo

CPU = NodeInfo("cpu", None, None)
REPO = Path(__file__).resolve().parents[2]


WAITS = textwrap.dedent("""
    import asyncio, json, subprocess, sys, time
    from deployments.serving.layout_check import DeferredLayoutCheck
    from dsv4_patch.node import NodeInfo, table_decision
    node = NodeInfo("cpu", None, None)
    check = DeferredLayoutCheck(node, table_decision(node), wait_s=60)
    time.sleep(1.0)
    asked_before_child = check._future.done()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        got = asyncio.run(asyncio.wait_for(check.contradiction(), 60))
    finally:
        child.kill()
    print("RESULT " + json.dumps({"asked_before_child": asked_before_child, "got": got}))
""")


def test_it_waits_for_a_child_then_confirms() -> None:
    """In a fresh process (a test runner has children of its own): nothing is asked
    until the process has a child, then vLLM's own class confirms the table."""
    done = subprocess.run([sys.executable, "-c", WAITS], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert json.loads(line.removeprefix("RESULT ")) == {"asked_before_child": False,
                                                         "got": None}


def test_without_a_child_it_asks_after_its_wait_and_reports_a_contradiction() -> None:
    wrong = rules.LayoutDecision(rules.Layout.PLAIN_ROWS, "cpu-dsv4", "a wrong table")
    check = DeferredLayoutCheck(CPU, wrong, wait_s=0.2)
    problem = asyncio.run(asyncio.wait_for(check.contradiction(), 60))
    assert problem is not None and "DeepseekV4CPUAttention" in problem


def test_an_error_in_the_check_reaches_the_replica() -> None:
    check = DeferredLayoutCheck(NodeInfo("nope", None, None), rules.LayoutDecision(
        rules.Layout.FP8_DS_MLA, "x", "y"), wait_s=0)
    with pytest.raises(rules.LayoutError, match="platform='nope'"):
        asyncio.run(asyncio.wait_for(check.contradiction(), 60))
