"""The repository as files: what the house checks (tests/test_house/) read."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The folders of the fixed layout (README "Layout"); nothing else is ours to check.
SOURCE_DIRS = ("deployments", "dsv4_patch", "configs", "tests", "k8s", "docs", "benchmarks",
               "scripts")
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


@cache
def defined_names(path: Path) -> frozenset[str]:
    """Top-level and class-level names a Python file defines or imports (``Cls.meth`` too)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(prefix + node.name)
            elif isinstance(node, ast.ClassDef):
                names.add(prefix + node.name)
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            names.add(prefix + name.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and not prefix:
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)) and not prefix:
                visit(node.body, prefix)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body, prefix)
                visit(node.orelse, prefix)
    visit(tree.body, "")
    return frozenset(names)
