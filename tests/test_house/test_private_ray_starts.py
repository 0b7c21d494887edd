"""Every Ray cluster this repository starts runs on a private token (issue 52).

Ray 2.60, left to itself, writes ``~/.ray/auth_token`` with the umask's mode (0644 here)
for a new local cluster: any local user could then read it and drive every later cluster
of this user. Each module that starts one with ``ray.init(address="local", ...)`` must
also call ``ray_token.use_private_token()`` (checked, 0600); read statically (ast).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.house import REPO, python_files


def local_starts(tree: ast.AST) -> list[int]:
    """Lines of ``ray.init(address="local", ...)`` calls."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "init" and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "ray"
            and any(k.arg == "address" and isinstance(k.value, ast.Constant)
                    and k.value.value == "local" for k in node.keywords)]


def names_private_token(tree: ast.AST) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "use_private_token"
               for node in ast.walk(tree))


def test_every_local_ray_start_names_a_private_token() -> None:
    found, missing = [], []
    for path in python_files("deployments", "benchmarks", "scripts", "tests"):
        tree = ast.parse(Path(path).read_text())
        lines = local_starts(tree)
        found += lines
        if lines and not names_private_token(tree):
            missing.append(f"{path.relative_to(REPO)}:{lines}")
    assert found, "no ray.init(address='local') found: the check reads nothing"
    assert not missing, (
        f"{missing} start a local Ray cluster without ray_token.use_private_token(): Ray "
        "would write ~/.ray/auth_token world-readable. Fix: call it before ray.init.")


def test_the_check_catches_a_start_without_the_token() -> None:
    bare = ast.parse('import ray\nray.init(address="local", num_cpus=1)\n')
    assert local_starts(bare) == [2] and not names_private_token(bare)
    named = ast.parse('ray_token.use_private_token()\nray.init(address="local")\n')
    assert names_private_token(named)
