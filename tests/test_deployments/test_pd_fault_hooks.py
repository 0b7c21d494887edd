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
    ([0, 0], {7}), ([0, 2], {9}), ([0, -1], {9}), ([0, -3], {7}), ([2, 0], {40}),
    ([0, 3], set()), ([0, -4], set()), ([1, 0], set()), ([3, 0], set()), ([-1, 0], set())])
def test_a_block_is_named_by_its_group_and_place(block: list[int], expected: set[int]) -> None:
    assert pd_faults.chosen_blocks(GROUPS, {"fault": "zero_span", "block": block}) == expected


def test_a_layer_names_every_block_of_its_group() -> None:
    fault = {"fault": "zero_span", "layer": "model.layers.2.attn.compressor.state_cache"}
    assert pd_faults.chosen_blocks(GROUPS, fault, layer_group=0) == {7, 8, 9}
    assert pd_faults.chosen_blocks(GROUPS, fault, layer_group=1) == set()
    assert pd_faults.chosen_blocks(GROUPS, fault, layer_group=None) == set()


def test_no_block_or_layer_named_means_every_page() -> None:
    assert pd_faults.chosen_blocks(GROUPS, {"fault": "zero_span", "segment": 2}) is None


ROW = [(0, 8192, "a.indexer.compressor.state_cache"), (0, 32768, "b.compressor.state_cache"),
       (37440, 37376, "c.swa_cache")]


@pytest.mark.parametrize(("fault", "span"), [
    ({"layer": "b.compressor.state_cache"}, (0, 32768)),
    ({"layer": "b.compressor.state_cache", "keep": 8192}, (8192, 32768)),
    ({"layer": "b.compressor.state_cache", "keep": 10**6}, (32768, 32768)),
    ({"layer": "c.swa_cache"}, (37440, 74816)),
    ({"layer": "no.such.layer"}, (0, 0))])
def test_a_layer_loses_its_own_page_past_what_arrives(fault: dict[str, Any],
                                                      span: tuple[int, int]) -> None:
    assert pd_faults.layer_span(ROW, 93888, fault) == span


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
    ({"fault": "zero_span", "layer": "m.layers.2.attn.compressor.state_cache"},
     "zero_span (layer m.layers.2.attn.compressor.state_cache)"),
    ({"fault": "zero_span", "layer": "x", "keep": 8192}, "zero_span (layer x, keep 8192)"),
    ({"fault": "truncate_region", "keep": "half"}, "truncate_region (keep half)"),
    ({"fault": "truncate_region", "keep": "smallest"}, "truncate_region"),
    ({"fault": "drop_region", "region": 0}, "drop_region")])
def test_each_probe_has_a_row_of_its_own(fault: dict[str, Any], name: str) -> None:
    assert case_name(fault) == name
