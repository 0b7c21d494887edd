"""Who may import whom across tests/, benchmarks/ and the package, read from the source (ast).

A test module never imports another test module or ``conftest`` (shared helpers live in
``tests/support/``); tests import no benchmark and benchmarks import no test (what both
use is ``deployments.harness``); the package imports neither, and only the harness itself
and the callers above it import ``deployments.harness``.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

from tests.support.house import REPO, python_files


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) for every import in ``path``, relative ones resolved."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append((node.lineno, module))
            # ``from tests.test_deployments import test_front`` imports the module too.
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def is_test_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "tests" and (
        any(p.startswith("test_") for p in parts[1:]) or parts[-1] == "conftest")


def offences(paths: list[Path], refused: Callable[[Path, str], str | None]) -> list[str]:
    """One line per refused import statement."""
    found: dict[tuple[Path, int], str] = {}
    for path in paths:
        for line, name in imported(path):
            if (path, line) not in found and (why := refused(path, name)):
                found[path, line] = f"{path.relative_to(REPO)}:{line} imports {name}: {why}"
    return list(found.values())


def test_no_test_module_imports_another_or_a_benchmark():
    def refused(path: Path, name: str) -> str | None:
        if is_test_module(name) and module_name(path) != name:
            return "a test module; move the shared part to tests/support/"
        if name == "benchmarks" or name.startswith("benchmarks."):
            return "a benchmark; what tests and benchmarks share is deployments.harness"
        return None

    found = offences(python_files("tests"), refused)
    assert not found, "\n".join(found)


def test_benchmarks_and_the_package_import_no_tests():
    def refused(path: Path, name: str) -> str | None:
        top = name.split(".")[0]
        if top == "tests":
            return "test code; the package and benchmarks never import tests/"
        if top == "benchmarks" and path.parts[len(REPO.parts)] != "benchmarks":
            return "a benchmark; the package never imports benchmarks/"
        if name.startswith("deployments.harness") and path.parts[len(REPO.parts)] in (
                "deployments", "dsv4_patch") and "harness" not in path.parts:
            return "the harness; serving code never depends on test drivers"
        return None

    found = offences(python_files("benchmarks", "deployments", "dsv4_patch"), refused)
    assert not found, "\n".join(found)


def test_the_check_sees_each_kind_of_import(tmp_path: Path) -> None:
    probe = REPO / "tests" / "support" / "house.py"
    assert (probe.stat().st_size and imported(probe))
    assert is_test_module("tests.test_deployments.test_front")
    assert is_test_module("tests.conftest")
    assert not is_test_module("tests.support.stack")
    assert module_name(REPO / "tests/support/__init__.py") == "tests.support"
    names = [n for _, n in imported(REPO / "tests" / "conftest.py")]
    assert "tests.support.stack" in names
