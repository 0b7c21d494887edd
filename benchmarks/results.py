"""Benchmark results as data: one JSON file per benchmark under ``benchmarks/results/``.

``write_result`` is what every benchmark ends with: it fills in when (``date``, ISO UTC),
on what code (``commit``) and on what host (CPU model, the SIMD/AMX flags that decide
which kernels ran, cores) the numbers were measured, and writes
``benchmarks/results/<name>.json``. ``docs/benchmarks.md`` is generated from these
files (``python -m benchmarks.report``); history stays in git.
"""

from __future__ import annotations

import datetime as dt
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from deployments.harness.records import commit, host

RESULTS = Path(__file__).resolve().parent / "results"
KEYS = ("benchmark", "title", "what", "command", "date", "commit", "host", "inputs",
        "columns", "rows", "notes")
def check(result: dict[str, Any]) -> None:
    """Raise ValueError naming the first key or row that breaks the schema."""
    missing = [k for k in KEYS if k not in result]
    if missing:
        raise ValueError(f"result {result.get('benchmark')!r} lacks {missing}; expected the "
                         f"keys {list(KEYS)} (benchmarks/results.py:write_result fills them)")
    width = len(result["columns"])
    for i, row in enumerate(result["rows"]):
        if len(row) != width:
            raise ValueError(f"result {result['benchmark']!r} row {i} has {len(row)} cells, "
                             f"expected {width} (columns {result['columns']})")


def write_result(name: str, *, title: str, what: str, command: str, inputs: dict[str, Any],
                 columns: list[str], rows: list[list[Any]], notes: str = "",
                 date: str | None = None, commit_id: str | None = None,
                 host_info: dict[str, Any] | None = None, folder: Path = RESULTS) -> Path:
    """Write ``<folder>/<name>.json``; ``date``/``commit_id``/``host_info`` default to now,
    this checkout and this machine (given only when carrying an older measurement over)."""
    result = {
        "benchmark": name, "title": title, "what": what, "command": command,
        "date": date or dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit_id or commit(), "host": host_info or host(), "inputs": inputs,
        "columns": columns, "rows": rows, "notes": notes,
    }
    check(result)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    return path


def load_results(folder: Path = RESULTS) -> list[dict[str, Any]]:
    """Every result file, checked, in name order."""
    found = []
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        check(result)
        if result["benchmark"] != path.stem:
            raise ValueError(f"{path}: benchmark {result['benchmark']!r} differs from the "
                             "file name; expected the two to match")
        found.append(result)
    return found


def markdown_tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Each markdown table in ``text`` a benchmark printed: (the line above it, its
    columns, its rows), cells as printed (``\\|`` inside a cell stays one cell)."""
    found: list[tuple[str, list[str], list[list[str]]]] = []
    lines, caption, i = text.splitlines(), "", 0

    def cells(line: str) -> list[str]:
        parts = line.strip().strip("|").replace("\\|", "\0").split("|")
        return [p.strip().replace("\0", "|") for p in parts]

    def header(at: int) -> bool:
        rule = lines[at + 1].strip() if at + 1 < len(lines) else ""
        return (lines[at].strip().startswith("|") and rule.startswith("|")
                and set(rule) <= set("|-: "))

    while i < len(lines):
        line = lines[i].strip()
        if header(i):
            columns, rows, i = cells(line), [], i + 2
            while i < len(lines) and lines[i].strip().startswith("|") and not header(i):
                rows.append(cells(lines[i]))
                i += 1
            found.append((caption, columns, rows))
            continue
        if line:
            caption = line
        i += 1
    return found


def write_tables(name: str, printed: str, *, title: str, what: str, command: str,
                 inputs: dict[str, Any], notes: str = "", folder: Path = RESULTS) -> list[Path]:
    """The markdown tables a run printed, as data: ``<name>.json`` for one table,
    ``<name>_<k>.json`` (title ``... (table k)``, the line above the table in its notes)
    for several. Raises ValueError when the run printed no table."""
    tables = markdown_tables(printed)
    if not tables:
        raise ValueError(f"{name}: the run printed no markdown table; expected at least one "
                         "(| header |, |---|, rows) to write as its result")
    if len(tables) == 1:
        _, columns, rows = tables[0]
        return [write_result(name, title=title, what=what, command=command, inputs=inputs,
                             columns=columns, rows=[list(r) for r in rows], notes=notes,
                             folder=folder)]
    return [write_result(f"{name}_{k}", title=f"{title} (table {k})", what=what,
                         command=command, inputs=inputs, columns=columns,
                         rows=[list(r) for r in rows],
                         notes="\n\n".join(n for n in (caption, notes) if n), folder=folder)
            for k, (caption, columns, rows) in enumerate(tables, 1)]


def this_command(module: str) -> str:
    """The command line this run was started with, as a result's ``command``."""
    return shlex.join(["python", "-m", module, *sys.argv[1:]])
