"""The local cluster's start, as `dsv4-serve run` does it: Ray notices its own raylet
promptly (``ray.prompt_node_registration``) and Serve's proxies are awaited after the
deploy starts, not before (``serve.controller_before_proxies``), in a fresh process."""

from __future__ import annotations

import textwrap

import pytest

from deployments import ray_touches
from tests.support.fresh_process import run_script


def test_both_touches_are_present_in_the_pinned_ray() -> None:
    assert ray_touches.present("ray.prompt_node_registration")
    assert ray_touches.present("serve.controller_before_proxies")


START = textwrap.dedent("""
    import json, urllib.error, urllib.request
    import ray
    from ray import serve
    from ray._private import services
    from deployments.config import DEFAULT_CONFIG, load_serve_config
    from deployments.local import ray_head
    config = load_serve_config(DEFAULT_CONFIG)
    real_get_node = services.get_node
    started = ray_head.start_cluster(config, num_cpus=ray_head.logical_cpus_needed(config),
                                     wait_for_proxies=False)
    try:
        result = {"get_node_restored": services.get_node is real_get_node,
                  "cpus": started.cpus, "apps": sorted(serve.status().applications)}
        started.proxies_ready()
        url = f"http://127.0.0.1:{config.http_options.port}/-/routes"
        try:  # the proxy answers; with no application yet its route table is empty
            with urllib.request.urlopen(url, timeout=10) as resp:
                result["routes_status"] = resp.status
        except urllib.error.HTTPError as exc:
            result["routes_status"] = exc.code
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        ray_head.shutdown()
""")


@pytest.mark.slow
def test_the_local_start_defers_the_proxies_and_polls_the_raylet() -> None:
    result, logs = run_script(START)
    assert result["get_node_restored"], result
    assert result["apps"] == [], result  # the client Serve's API uses was registered
    # Serve's proxy answers (503: no route table before the first app), awaited after
    # the start returned
    assert result["routes_status"] in (200, 503), result
    assert "raylet was in the GCS" in logs, logs[-3000:]
    assert "proxies are awaited after the deploy starts" in logs, logs[-3000:]
