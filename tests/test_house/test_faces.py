"""Public faces: each ``__all__`` lists only public names the module really defines.

``__all__`` is what users import or name in YAML (``deployments.app:build_app``), so a
private name (``_Strict``) or a name that moved away does not belong there. Read
statically (ast); nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.house import REPO, defined_names, python_files


def declared(path: Path) -> list[str] | None:
    """The literal ``__all__`` of ``path``, or None when it declares none."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                assert isinstance(node.value, (ast.List, ast.Tuple)), f"{path}: __all__ literal"
                return [ast.literal_eval(e) for e in node.value.elts]
    return None


def test_every_face_lists_public_names_it_defines():
    found = []
    for path in python_files("deployments", "dsv4_patch"):
        names = declared(path)
        for name in names or ():
            if name.startswith("_"):
                found.append(f"{path.relative_to(REPO)}: __all__ lists private {name!r}")
            elif name not in defined_names(path):
                found.append(f"{path.relative_to(REPO)}: __all__ lists {name!r}, not defined "
                             "or imported there")
    assert not found, "\n".join(found)


def test_the_app_offers_what_users_name():
    assert declared(REPO / "deployments" / "app.py") == ["build_app", "build_parsed_app"]
