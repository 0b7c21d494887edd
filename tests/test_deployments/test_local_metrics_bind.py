"""The private local cluster's ports, Ray's metrics endpoint among them, bind loopback.

Ray 2.60's dashboard agent serves Prometheus (no auth) on ``get_localhost_ip()``
only when the node IP is loopback, else on every interface; on Linux ``ray.init``
picks the routable IP and turns ``_node_ip_address="127.0.0.1"`` back into it
(``deployments.ray_touches``: ``ray.loopback_node_ip``). Measured here before the
fix: node 192.0.2.2, metrics on 0.0.0.0; after: node 127.0.0.1, every Ray listener
on 127.0.0.1.
"""

from __future__ import annotations

import textwrap

import pytest

from deployments import ray_touches
from deployments.local import ray_head
from tests.support.fresh_process import run_script


def test_the_touch_is_present_in_the_pinned_ray() -> None:
    assert ray_touches.present("ray.loopback_node_ip")


def test_inside_the_context_ray_picks_loopback_and_restores_after(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ray._private import ray_constants, services, worker

    # as in a fresh `dsv4-serve run` process: no node yet (another test may have one)
    monkeypatch.setattr(worker, "_global_node", None)
    before = ray_constants.ENABLE_RAY_CLUSTER
    with ray_head.loopback_node_ip():
        assert services.get_node_ip_address() == "127.0.0.1"
    assert ray_constants.ENABLE_RAY_CLUSTER == before


PROBE = textwrap.dedent("""
    import json, socket
    from ray._common.network_utils import node_ip_address_from_perspective
    from deployments.config import DEFAULT_CONFIG, load_serve_config
    from deployments.local import ray_head
    import ray
    config = load_serve_config(DEFAULT_CONFIG)
    ray_head.start_cluster(config, num_cpus=ray_head.logical_cpus_needed(config))
    try:
        node = [n for n in ray.nodes() if n["Alive"]][0]
        port = node["MetricsExportPort"]
        def reachable(host):
            try:
                socket.create_connection((host, port), timeout=2).close()
                return True
            except OSError:
                return False
        outside = node_ip_address_from_perspective(None)
        print("RESULT " + json.dumps({"node": node["NodeManagerAddress"], "outside": outside,
                          "loopback": reachable("127.0.0.1"),
                          "routable": reachable(outside)}))
    finally:
        ray_head.shutdown()
""")


@pytest.mark.slow
def test_the_local_metrics_port_answers_on_loopback_only() -> None:
    result, _ = run_script(PROBE)
    assert result["node"] == "127.0.0.1", result
    assert result["loopback"], result
    if result["outside"] != "127.0.0.1":  # a machine with a routable address
        assert not result["routable"], result
