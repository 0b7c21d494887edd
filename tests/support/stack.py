"""The session stack's shape: what ``tests/conftest.py``'s fixtures yield and deploy.

Plain names (no fixtures): the ``Stack`` the ``serve_stack`` fixture yields, and the
mixed app the ``mixed_app`` fixture deploys (rank ``ODD_RANK`` on ``ODD_ENGINE_KWARGS``),
which tests import to know which replica is meant to differ.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deployments.config import ServeConfig

MIXED_APP = "mixed"
MIXED_ROUTE = "/mixed"
# rank 0 of the mixed app: the tiny model's layers 2 (C128) and 3 (C4) swapped.
ODD_RANK = 0
ODD_ENGINE_KWARGS = {"hf_overrides": {"compress_ratios": [0, 4, 4, 128, 0]}}


@dataclass
class Stack:
    """The running session stack: config, base URLs, timings."""

    config: ServeConfig
    url: str  # OpenAI base URL of the main app (…/v1)
    model: str
    running_s: dict[str, float]
    cluster_s: float
    # The API-key file the session's ingress re-reads (DSV4_API_KEYS_FILE): empty, so the
    # loopback app is open; tests/test_deployments/test_serve_security.py writes keys into it
    # and empties it.
    keys_file: Path | None = None


def mixed_app_args(base: dict[str, Any]) -> dict[str, Any]:
    """The local app, with rank 0 on another layer order, under policy warn; and with
    the Responses store on (SQLite, the default), so follow-ups cross replicas
    (``tests/test_deployments/test_responses_live.py``)."""
    args = copy.deepcopy(base)
    args["http"]["responses_store"] = True
    # Served through Serve's proxy at its route prefix (the second door), not on the
    # main app's own replica port: replicas sharing a port must serve one app.
    args["http"].pop("replica_port", None)
    args["dsv4"].update(
        policy="warn",
        controller_period_s=2,
        enforce_backoff_s=600,  # one replacement, then drained: a boot per test, not a loop
        replica_overrides=[{"rank": ODD_RANK, "engine_kwargs": ODD_ENGINE_KWARGS,
                            "reason": "test: a replica configured to differ"}],
    )
    return args
