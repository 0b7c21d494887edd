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

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from deployments.config import DEFAULT_CONFIG, load_serve_config
from tests.support.redis_server import RedisServer, free_port
from tests.support.redis_server import binary as redis_binary
from tests.support.stack import MIXED_APP, MIXED_ROUTE, Stack, mixed_app_args

TESTS = Path(__file__).resolve().parent
# The mirror folders are pyproject's testpaths, read from there (one list). Named
# test_<package>, not <package>: were tests/ ever on a process's path, a tests/dsv4_patch/
# would shadow the real plugin and tests/packaging/ PyPI's packaging. Shared helpers sit
# in tests/support/ (plain names; this file holds only hooks and fixtures).


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


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server for the Responses store tests (127.0.0.1, a free port)."""
    exe = redis_binary()
    if exe is None:
        pytest.skip("no redis-server/valkey-server on PATH: `make setup` installs "
                    "Debian's redis-server (as root)")
    server = RedisServer(exe, free_port(), tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def serve_stack() -> Iterator[Stack]:
    from deployments.local import client, deploy, ray_head

    config = load_serve_config(DEFAULT_CONFIG)
    [(app, args)] = config.ours()
    # Ray's processes inherit this environment: the ingress reads its keys from the file.
    keys_file = Path(tempfile.mkdtemp(prefix="dsv4-keys-")) / "api-keys"
    keys_file.write_text("none\n")  # no key on purpose (an empty read is a bad edit)
    os.environ.pop("DSV4_API_KEYS", None)  # a developer's own key would close the app
    os.environ["DSV4_API_KEYS_FILE"] = str(keys_file)
    started = time.monotonic()
    # Room for the mixed app too: Ray places replicas by logical CPUs.
    local = ray_head.start_cluster(config, num_cpus=2 * ray_head.logical_cpus_needed(config),
                                   wait_for_proxies=False)  # as `dsv4-serve run`
    cluster_s = round(time.monotonic() - started, 1)
    try:
        running = deploy.deploy(config)
        local.proxies_ready()
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
