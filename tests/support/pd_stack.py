"""The P/D apps of the P/D tests: ``configs/local-cpu-pd.yaml``'s args, deployed next to
the session stack (tests/test_deployments/test_pd_*.py)."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import yaml

from tests.support.stack import Stack

REPO = Path(__file__).resolve().parents[2]
PD_CONFIG = REPO / "configs" / "local-cpu-pd.yaml"


def pd_args(**changes: Any) -> dict[str, Any]:
    raw = yaml.safe_load(PD_CONFIG.read_text())["applications"][0]["args"]
    args = copy.deepcopy(raw)
    for pool in ("prefill", "decode"):
        args["pd"][pool] |= changes.pop(pool, {})
    args["pd"] |= changes
    return args


def deploy(stack: Stack, name: str, args: dict[str, Any]) -> str:
    """Deploy one P/D app next to the session stack; return its OpenAI base URL."""
    import ray

    from deployments.config import ServeApplication
    from deployments.local import deploy as deploying
    from deployments.local import ray_head

    entry = ServeApplication(name=name, route_prefix=f"/{name}",
                             import_path="deployments.app:build_app", args=args)
    config = stack.config.model_copy(update={"applications": [entry]})
    needed, deadline = ray_head.logical_cpus_needed(config), time.monotonic() + 60
    while (free := ray.available_resources().get("CPU", 0)) < needed:  # a deleted app's
        assert time.monotonic() < deadline, (  # actors release theirs as they exit
            f"{free} logical CPUs free; the P/D app needs {needed} (both pools at their "
            "max): another test's app is still deployed")
        time.sleep(1)
    deploying.deploy(config)
    return deploying.base_url(config, f"/{name}")
