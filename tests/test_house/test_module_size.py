"""No product module over 350 lines: one module per job, small enough to read at once.

A module that grows past the bound is split by job (whole functions or classes moved
into a new, named module), not trimmed. Static: the product's files.
"""

from __future__ import annotations

from tests.support.house import REPO

PRODUCT = ("deployments", "dsv4_patch")
MAX_LINES = 350


def test_no_product_module_is_over_350_lines() -> None:
    over = {}
    for top in PRODUCT:
        for path in sorted((REPO / top).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                over[path.relative_to(REPO).as_posix()] = lines
    assert not over, (f"modules over {MAX_LINES} lines: {over}. Fix: split each by job "
                      "(move whole functions or classes into a new module, re-import).")
