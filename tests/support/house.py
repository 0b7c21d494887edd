"""The repository as files: what the house checks (tests/test_house/) read."""

from __future__ import annotations

from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The folders of the fixed layout (README "Layout"); nothing else is ours to check.
SOURCE_DIRS = ("deployments", "dsv4_patch", "configs", "tests", "k8s", "docs", "benchmarks")
_SKIP = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}


@cache
def repo_files() -> tuple[str, ...]:
    """Every file under the layout's folders, as repo-relative POSIX paths."""
    found: list[str] = []
    for top in SOURCE_DIRS:
        for path in (REPO / top).rglob("*"):
            if path.is_file() and not _SKIP & set(path.parts):
                found.append(path.relative_to(REPO).as_posix())
    return tuple(sorted(found))


def python_files(*tops: str) -> list[Path]:
    """The .py files under ``tops`` (repo-relative folder names)."""
    return [REPO / f for f in repo_files() if f.endswith(".py") and f.split("/")[0] in tops]
