"""Session fixtures: ONE local Ray cluster and the Serve app(s), booted the way users do.

``serve_stack`` starts the cluster and deploys ``configs/local-cpu.yaml`` through
``deployments.local.ray_head``/``deploy`` (the code behind ``dsv4-serve run``), once per session.
``mixed_app`` adds a second small application to the same cluster, once, only
when a test asks for it: two replicas where rank 0 (a canary, declared in
``replica_overrides``) runs the tiny model with two layer kinds swapped
(``compress_ratios`` [0, 4, 4, 128, 0] instead of [0, 4, 128, 4, 0]), under
policy ``warn``, so the controller has something to catch. The two replicas hold
the same multiset of KV caches -- same page sizes, same counts -- but not layer
for layer: only a per-layer fingerprint or the prediction tells them apart, and
rank 0 loses a 1-1 tie only because it is judged against the prediction.
"""

from __future__ import annotations

import copy
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments.config import DEFAULT_CONFIG, ServeConfig, load_serve_config

SERVING_LINE = "Serving; Ctrl-C to stop."
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


TESTS = Path(__file__).resolve().parent
# The mirror folders are pyproject's testpaths, read from there (one list). Named
# test_<package>, not <package>: engine subprocesses get tests/ on PYTHONPATH
# (engine_site's hooks import its harnesses by top-level name), where a tests/dsv4_patch/
# would shadow the real plugin and tests/packaging/ PyPI's packaging.


def pytest_configure(config: pytest.Config) -> None:
    """Refuse a test file outside the mirror tree: pyproject's testpaths would skip it."""
    mirrors = tuple(Path(p).name for p in config.getini("testpaths"))
    strays = sorted(p.relative_to(TESTS.parent).as_posix() for p in TESTS.glob("test_*.py"))
    strays += sorted(p.relative_to(TESTS.parent).as_posix() for p in TESTS.glob("*/test_*.py")
                     if p.parent.name not in mirrors)
    if strays:
        raise pytest.UsageError(
            f"test files outside the mirror tree would never run: {', '.join(strays)}; "
            f"expected tests/test_<package>/test_<module>.py in one of {mirrors}. "
            "Fix: git mv each into the package its module belongs to (or add the new "
            "package to pyproject's testpaths).")


def read_until_serving(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """``dsv4-serve run``'s output up to its "Serving" line (or EOF, or ``timeout_s``).

    The caller asserts ``SERVING_LINE`` is in the text; on a failed boot the text
    ends with the error. The deadline is checked between lines: the run prints
    progress while it boots.
    """
    assert proc.stdout is not None, "start the run with stdout=subprocess.PIPE"
    lines: list[str] = []
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(SERVING_LINE):
            break
    return "".join(lines)


def mixed_app_args(base: dict[str, Any]) -> dict[str, Any]:
    """The local app, with rank 0 on another layer order, under policy warn."""
    args = copy.deepcopy(base)
    args["dsv4"].update(
        policy="warn",
        controller_period_s=2,
        enforce_backoff_s=600,  # one replacement, then drained: a boot per test, not a loop
        replica_overrides=[{"rank": ODD_RANK, "engine_kwargs": ODD_ENGINE_KWARGS,
                            "reason": "test: a replica configured to differ"}],
    )
    return args


@pytest.fixture(scope="session")
def serve_stack() -> Iterator[Stack]:
    from deployments.local import client, deploy, ray_head

    config = load_serve_config(DEFAULT_CONFIG)
    [(app, args)] = config.ours()
    # Ray's processes inherit this environment: the ingress reads its keys from the file.
    keys_file = Path(tempfile.mkdtemp(prefix="dsv4-keys-")) / "api-keys"
    keys_file.write_text("")
    os.environ.pop("DSV4_API_KEYS", None)  # a developer's own key would close the app
    os.environ["DSV4_API_KEYS_FILE"] = str(keys_file)
    started = time.monotonic()
    # Room for the mixed app too: Ray places replicas by logical CPUs.
    ray_head.start_cluster(config, num_cpus=2 * ray_head.logical_cpus_needed(config))
    cluster_s = round(time.monotonic() - started, 1)
    try:
        running = deploy.deploy(config)
        url = deploy.base_url(config, app.route_prefix)
        client.wait_for_verdict(url)
        yield Stack(config, url, args.llm.model_loading_config.model_id, running, cluster_s,
                    keys_file)
    finally:
        ray_head.shutdown()


@pytest.fixture(scope="session")
def mixed_app(serve_stack: Stack) -> Iterator[str]:
    """Deploy the disagreeing app once; yield its OpenAI base URL; delete it after."""
    from ray import serve

    from deployments.config import ServeApplication
    from deployments.local import deploy

    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    args = mixed_app_args(raw["applications"][0]["args"])
    entry = ServeApplication(name=MIXED_APP, route_prefix=MIXED_ROUTE,
                             import_path="deployments.app:build_app", args=args)
    config = serve_stack.config.model_copy(update={"applications": [entry]})
    deploy.deploy(config)
    url = deploy.base_url(config, MIXED_ROUTE)
    try:
        yield url
    finally:
        serve.delete(MIXED_APP)
