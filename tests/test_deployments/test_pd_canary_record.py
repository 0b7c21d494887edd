"""benchmarks/results/pd_canary.json is the pool of the committed canary runs, and it
holds what issue 54 claims of it: no clean canary failed on any host kind, every
injected fault kind failed every canary run under it, and the hook fired each time; the
resolution probes' misses are named in its notes.

A new run adds a file to benchmarks/results/pd_canary_runs/; writing the record again
(``python -m benchmarks.pd_canary --from-runs benchmarks/results/pd_canary_runs``) keeps
this test green, and a false positive in any run turns it red."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deployments.config.pd import CanarySection
from deployments.harness import canary_runs as pd_canary
from deployments.harness.records import REPO

RECORD = REPO / "benchmarks" / "results" / "pd_canary.json"


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    return dict(json.loads(RECORD.read_text()))


def _rows(record: dict[str, Any], case: str) -> list[list[Any]]:
    return [r for r in record["rows"] if r[0].split(" · ")[0].split(" (")[0] == case]


def test_the_record_is_the_pool_of_the_committed_runs(record: dict[str, Any]) -> None:
    pooled = pd_canary.from_runs([pd_canary.RUNS_DIR], record["inputs"]["max_tokens"])
    rows = json.loads(json.dumps(pd_canary.rows_of(pooled)))
    assert rows == record["rows"], (
        "benchmarks/results/pd_canary.json differs from its runs; write it again with "
        "`python -m benchmarks.pd_canary --from-runs benchmarks/results/pd_canary_runs`")
    files = [str(f.relative_to(REPO)) for f in pd_canary.runs_files(
        [pd_canary.RUNS_DIR])]
    assert record["inputs"]["runs"] == files


def test_every_run_names_a_known_host_kind() -> None:
    for path in pd_canary.runs_files([pd_canary.RUNS_DIR]):
        kinds = {json.loads(line)["host_kind"] for line in path.read_text().splitlines()}
        assert kinds <= set(pd_canary.KINDS), f"{path.name}: host kinds {kinds}"
        assert path.stem.endswith(tuple(kinds)), f"{path.name} names another host kind"


def test_no_clean_canary_failed_on_any_host_kind(record: dict[str, Any]) -> None:
    clean = _rows(record, "clean")
    assert clean, "no clean canaries recorded"
    for row in clean:
        assert row[2] == 0, f"{row[0]}: {row[2]} of {row[1]} clean canaries failed"


def test_two_hundred_clean_canaries_per_host_kind_at_the_default_prompt(
        record: dict[str, Any]) -> None:
    """Issue 54's no-false-positive claim rests on at least 200 clean canaries of the
    default prompt length (``pd.canary.prompt_tokens``) on AVX2 and on AVX-512 hosts."""
    length = CanarySection().prompt_tokens
    counts = record["inputs"]["clean_canaries_per_pool"]
    for kind in ("avx2", "avx512"):
        name = pd_canary.pool(kind, length)
        assert counts.get(name, 0) >= 200, (
            f"{name}: {counts.get(name, 0)} clean canaries recorded, 200 claimed. Fix: on "
            "such a host, `make bench-pd-canary`, then commit its runs file and the record")
    assert {pd_canary.pool_kind(name) for name in counts} <= set(pd_canary.KINDS), counts


def test_every_fault_kind_is_caught_every_time(record: dict[str, Any]) -> None:
    pools = {r[0].split(" · ", 1)[1] for r in record["rows"]}
    for kind in pools:
        faults = [r for r in record["rows"] if r[0].split(" · ", 1)[1] == kind
                  and not r[0].startswith("clean")]
        if not faults:
            continue  # a pool with clean canaries only
        names = {r[0].split(" ")[0] for r in faults}
        assert set(pd_canary.FAULTS) <= names <= {*pd_canary.FAULTS, *pd_canary.PROBES}, kind
        for row in faults:
            assert row[8] == f"hook fired in {row[1]}/{row[1]}", f"{row[0]}: {row[8]}"
            if row[0].split(" ")[0] in pd_canary.FAULTS:
                assert row[2] == row[1] > 0, f"{row[0]}: caught {row[2]} of {row[1]}"


def test_the_record_names_every_probe_the_canary_did_not_see(record: dict[str, Any]) -> None:
    """A span of the row whose zeroing got past the canary is the canary's resolution,
    said in the record, not hidden in a row."""
    for name in pd_canary.missed_probes(record["rows"]):
        assert name in record["notes"], f"{name} got past the canary; the notes omit it"
