"""``ConfigError`` and the one format of a validation error: where, what was given, the fix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import (
    ValidationError,
)

# ------------------------------------------------------------------ errors


class ConfigError(ValueError):
    """A config the user must fix; the message lists every problem by field."""


def _fmt_loc(prefix: str, loc: tuple[Any, ...]) -> str:
    parts = [prefix] if prefix else []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        else:
            parts.append(str(item))
    return ".".join(parts) or "<root>"


def format_validation_error(exc: ValidationError, prefix: str) -> str:
    """One line per problem: where, what was given, what was expected (and the fix)."""
    lines = []
    for err in exc.errors(include_url=False):
        where = _fmt_loc(prefix, tuple(err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key. Fix: remove it or check the spelling"
        elif err["type"] == "missing":
            msg = "required key is missing. Fix: add it"
        got = err.get("input")
        shown = "" if err["type"] in ("missing",) or isinstance(got, Mapping) else f" (got {got!r})"
        lines.append(f"  {where}: {msg}{shown}")
    return "\n".join(lines)
