"""Parse ``build_app`` args: structure first (the models), then the policy rules (``checks``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import (
    ValidationError,
)

from deployments.config import checks
from deployments.config.app_args import AppArgs
from deployments.config.errors import ConfigError, format_validation_error
from deployments.config.pd import PDAppArgs


def args_model(args: Mapping[str, Any]) -> type[AppArgs]:
    """``AppArgs``, or its P/D form when ``args`` has a ``pd`` section."""
    if "pd" in args:
        return PDAppArgs
    return AppArgs


def refuse_problems(problems: list[checks.Finding], where: str,
                    label: str | None = None) -> None:
    """Raise ConfigError listing every error problem of ``check`` (warnings pass)."""
    found = checks.errors(problems)
    if found:
        lines = "\n".join(f"  {where}: {p.message}" for p in found)
        raise ConfigError(f"invalid {label or where}:\n{lines}")


def parse_app_args(args: Mapping[str, Any], where: str = "args", *, refuse: bool = True,
                   label: str | None = None) -> AppArgs:
    """Validate ``build_app`` args or raise ConfigError naming each bad field.

    Structure first (the pydantic models), then the policy rules of
    ``deployments.config.checks.check``; ``refuse=False`` keeps the policy problems for the
    caller to report (``dsv4-serve plan``). ``label`` names the file in the message.
    """
    try:
        parsed = args_model(args).model_validate(dict(args))
    except ValidationError as exc:
        raise ConfigError(f"invalid {label or where}:\n"
                          f"{format_validation_error(exc, where)}") from exc
    if refuse:
        refuse_problems(checks.check(parsed), where, label)
    return parsed
