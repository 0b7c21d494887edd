"""What every config model shares: strictness, the policy enum, the names and defaults a
config refers to.
"""

from __future__ import annotations

from enum import Enum

from pydantic import (
    BaseModel,
    ConfigDict,
)

from deployments import resources
from dsv4_patch import rules
from dsv4_patch.tiny_model import TINY_MODEL_NAME

IMPORT_PATH = "deployments.app:build_app"
WORKER_EXTENSION = "dsv4_patch.worker_ext.DSv4WorkerExtension"
# model_source alias of the tiny random-weight DeepSeek-V4 (one name: dsv4_patch.tiny_model).
TINY_MODEL_SOURCE = TINY_MODEL_NAME
PLUGIN_NAME = rules.PLUGIN_NAME
DEFAULT_CONFIG = resources.configs_dir() / "local-cpu.yaml"
# Seconds a stopping DSv4 server replica waits for its in-flight requests (Serve's
# graceful_shutdown_timeout_s; Serve's own default of 20 s cuts long generations).
DEFAULT_DRAIN_TIMEOUT_S = 60.0
# How often a draining replica re-counts its requests (Serve's default is 2 s).
DEFAULT_DRAIN_POLL_S = 0.5


class Policy(str, Enum):
    """What the controller does with a replica whose KV spec disagrees."""

    ENFORCE = "enforce"  # fails its health check (Serve replaces it), bounded, then drain
    DRAIN = "drain"  # stays up for inspection; the request router sends it no requests
    WARN = "warn"  # reported over HTTP/metrics/logs; the replica keeps serving


class _Strict(BaseModel):
    """Unknown keys are typos until proven otherwise: reject them by name."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class _Open(BaseModel):
    """Typed where we decide something; everything else passes through untouched."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
