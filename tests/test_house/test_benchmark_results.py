"""Results as data: docs/benchmarks.md is generated from benchmarks/results/*.json.

Fails when the doc is stale (``python -m benchmarks.report`` fixes it), when any doc
cites a result file that is not committed, or when a result file breaks the schema
``benchmarks/results.py:write_result`` writes. Tests import no benchmark (the house
rule), so the benchmark modules run here as their own processes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.house import REPO

RESULTS = REPO / "benchmarks" / "results"
KEYS = ["benchmark", "title", "what", "command", "date", "commit", "host", "inputs",
        "columns", "rows", "notes"]
FLAGS = {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_the_doc_is_what_the_results_render(tmp_path: Path) -> None:
    fresh = tmp_path / "benchmarks.md"
    done = run("-m", "benchmarks.report", "--out", str(fresh))
    assert done.returncode == 0, done.stderr
    assert (REPO / "docs" / "benchmarks.md").read_text() == fresh.read_text(), (
        "docs/benchmarks.md is stale. Fix: python -m benchmarks.report")


def test_the_report_cli_checks_and_writes_no_stray_file(tmp_path: Path) -> None:
    helped = subprocess.run([sys.executable, "-m", "benchmarks.report", "--help"], cwd=tmp_path,
                            env=os.environ | {"PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=120, check=False)
    assert helped.returncode == 0 and "--check" in helped.stdout, helped.stderr
    assert list(tmp_path.iterdir()) == [], "--help wrote a file"
    stale = tmp_path / "stale.md"
    stale.write_text("# not the doc\n")
    assert run("-m", "benchmarks.report", "--check", "--out", str(stale)).returncode == 1
    assert stale.read_text() == "# not the doc\n"


def test_every_cited_result_file_is_committed() -> None:
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = [f"{doc.relative_to(REPO)} cites {name}" for doc in docs
               for name in sorted(set(re.findall(r"benchmarks/results/[\w.-]+\.json",
                                                 doc.read_text())))
               if not (REPO / name).is_file()]
    assert not missing, "\n".join(missing)


def test_every_result_file_holds_the_schema() -> None:
    paths = sorted(RESULTS.glob("*.json"))
    assert paths, "no result files under benchmarks/results/"
    for path in paths:
        result = json.loads(path.read_text())
        name = path.name
        assert list(result) == KEYS, f"{name}: keys {list(result)}, expected {KEYS}"
        assert result["benchmark"] == path.stem, name
        assert set(result["host"]) == {"cpu_model", "flags", "cores"}, name
        assert set(result["host"]["flags"]) <= FLAGS, name
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", result["commit"]), name
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", result["date"]), name
        assert isinstance(result["inputs"], dict) and result["columns"], name
        assert all(len(row) == len(result["columns"]) for row in result["rows"]), name


def test_write_result_fills_when_what_and_where(tmp_path: Path) -> None:
    probe = ("import sys; from pathlib import Path; from benchmarks.results import "
             "write_result; write_result('probe', title='t', what='w', command='c', "
             "inputs={'n': 1}, columns=['a', 'b'], rows=[[1, 2]], folder=Path(sys.argv[1]))")
    done = run("-c", probe, str(tmp_path))
    assert done.returncode == 0, done.stderr
    written = json.loads((tmp_path / "probe.json").read_text())
    assert list(written) == KEYS and written["rows"] == [[1, 2]]
    assert written["host"]["cores"] >= 1 and written["date"].endswith("+00:00")
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", written["commit"])
    bad = probe.replace("rows=[[1, 2]]", "rows=[[1]]")
    refused = run("-c", bad, str(tmp_path))
    assert refused.returncode != 0 and "row 0 has 1 cells, expected 2" in refused.stderr
