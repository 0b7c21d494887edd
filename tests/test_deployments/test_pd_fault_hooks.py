"""The P/D fault hooks' choices that need no engine: which block a ``zero_span`` probe
loses, which bytes of its page, and the record row it lands in. The hooks themselves run
on real NIXL pairs (test_pd_canary.py, benchmarks/pd_canary.py)."""

from __future__ import annotations

from typing import Any

import pytest

from deployments.harness.canary_runs import case_name
from tests.support import pd_faults

GROUPS = [[7, 8, 9], [], [40]]


@pytest.mark.parametrize(("block", "expected"), [
    ([0, 0], 7), ([0, 2], 9), ([0, -1], 9), ([0, -3], 7), ([2, 0], 40),
    ([0, 3], None), ([0, -4], None), ([1, 0], None), ([3, 0], None), ([-1, 0], None)])
def test_a_block_is_named_by_its_group_and_place(block: list[int], expected: int | None) -> None:
    assert pd_faults.chosen_block(GROUPS, {"fault": "zero_span", "block": block}) == expected


def test_no_block_named_means_every_page() -> None:
    assert pd_faults.chosen_block(GROUPS, {"fault": "zero_span", "segment": 2}) is None


def test_a_lost_block_loses_its_whole_page_unless_a_span_is_given() -> None:
    whole = {"fault": "zero_span", "region": 0, "block": [0, -1]}
    assert pd_faults.span_of(None, 0, 93888, whole) == (0, 93888)
    assert pd_faults.span_of(None, 0, 93888, whole | {"span": [100, 200]}) == (100, 200)


@pytest.mark.parametrize(("fault", "name"), [
    ({"fault": "zero_span", "segment": 3}, "zero_span (segment 3)"),
    ({"fault": "zero_span", "span": [0, 64]}, "zero_span (bytes 0-64)"),
    ({"fault": "zero_span", "block": [1, -1]}, "zero_span (block 1:-1)"),
    ({"fault": "zero_span", "block": [0, 2], "segment": 6},
     "zero_span (block 0:2, segment 6)"),
    ({"fault": "truncate_region", "keep": "half"}, "truncate_region (keep half)"),
    ({"fault": "truncate_region", "keep": "smallest"}, "truncate_region"),
    ({"fault": "drop_region", "region": 0}, "drop_region")])
def test_each_probe_has_a_row_of_its_own(fault: dict[str, Any], name: str) -> None:
    assert case_name(fault) == name
