"""Read a Serve config YAML and validate our applications' args."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import (
    ValidationError,
)

from deployments.config.base import DEFAULT_CONFIG, IMPORT_PATH
from deployments.config.errors import ConfigError, format_validation_error
from deployments.config.serve_file import ServeConfig


def load_serve_config(path: str | Path, *, refuse: bool = True) -> ServeConfig:
    """Read and validate a Serve config YAML, including our applications' args.

    Our args are parsed here once and kept on each application (``parsed``);
    ``refuse=False`` leaves policy problems to the caller (``deployments.config.checks``).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist. Fix: pass a Serve "
                          f"config YAML, e.g. {DEFAULT_CONFIG}.")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with `applications:`, got "
                          f"{type(raw).__name__}.")
    try:
        config = ServeConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"invalid {path}:\n{format_validation_error(exc, '')}") from exc
    if not any(a.is_ours for a in config.applications):
        raise ConfigError(
            f"{path}: no application has import_path {IMPORT_PATH!r}. Fix: add one."
        )
    for app in config.applications:
        if app.is_ours:
            app.parse(refuse=refuse, label=str(path))
    try:
        config.check_replica_ports()
        config.ingress()
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return config
