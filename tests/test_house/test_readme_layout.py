"""README's layout names every package and module of the product, under its folder.

``test_docs_refs`` checks the other way (each name the layout gives exists). Together
they keep the layout block the tree's own: a module added, moved or removed without
the README fails here. Static: the README's text and the file tree.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.house import REPO

PRODUCT = ("deployments", "dsv4_patch")
ENTRY = re.compile(r"^  ([\w/]+)/\s")  # "  http/   the edge ..." opens a folder's entry


def layout_entries() -> dict[str, str]:
    """Folder (``deployments/http``) or top (``deployments``) -> its text in the block."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Layout\n+```\n(.*?)```", text, re.S)
    assert block, "README.md has no ## Layout block"
    entries: dict[str, str] = {}
    top: str | None = None
    key = ""
    for line in block.group(1).splitlines():
        if m := re.match(r"^(\w+)/\s", line):
            top = key = m.group(1)
            entries[key] = line[m.end():]
            continue
        if top is None:
            continue
        if (m := ENTRY.match(line)) and (REPO / top / m.group(1)).is_dir():
            key = f"{top}/{m.group(1)}"
            entries[key] = line[m.end():]
        elif re.match(r"^  \S", line):  # a line of the top's own files
            key = top
            entries[top] += " " + line
        else:
            entries[key] = entries.get(key, "") + " " + line
    return entries


def modules(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__"))


def test_the_layout_names_every_product_module() -> None:
    entries = layout_entries()
    missing = []
    for top in PRODUCT:
        for folder in sorted({p.parent for p in (REPO / top).rglob("__init__.py")}):
            rel = folder.relative_to(REPO).as_posix()
            if "_data" in rel:
                continue
            text = entries.get(rel)
            if text is None and rel != top:
                parent_text = entries.get(top, "")
                if f"{folder.name}/" in parent_text:  # named inline: ``ray_touches/ (...)``
                    continue
                missing.append(f"{rel}/: no entry in README's layout")
                continue
            missing += [f"{rel}/{stem}.py: not named in README's layout entry of {rel}/"
                        for stem in modules(folder)
                        if not re.search(rf"(?<![\w-]){re.escape(stem)}(?![\w-])", text or "")]
    assert not missing, "\n".join(missing)
