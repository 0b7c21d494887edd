"""The local multi-node cluster starts one log monitor per host, not one per node.

Ray's own fake provider runs its real node-creation code here; only the ``Node`` it
would start (real processes) is recorded instead. The whole cluster is checked by the
multi-node story (``test_multinode.py``: no log monitor in the run's session).
"""

from __future__ import annotations

from typing import Any

import pytest

from deployments.local import cluster

TAGS = {"ray-user-node-type": "dsv4.node"}


def _params_of_a_new_node(provider_cls: type, monkeypatch: pytest.MonkeyPatch) -> Any:
    from ray._private import node

    made: list[Any] = []

    class RecordedNode:
        def __init__(self, ray_params: Any, **_: object) -> None:
            made.append(ray_params)

    monkeypatch.setenv("RAY_FAKE_CLUSTER", "1")
    monkeypatch.setattr(node, "Node", RecordedNode)
    provider = provider_cls({"gcs_address": "127.0.0.1:1"}, "dsv4-local")
    provider.create_node_with_resources_and_labels({}, TAGS, 1, {"CPU": 1.0}, {})
    [params] = made
    return params


def test_worker_nodes_start_no_log_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray._private import parameter
    from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

    from deployments.local.node_provider import OneLogMonitorProvider

    real = parameter.RayParams
    ours = _params_of_a_new_node(OneLogMonitorProvider, monkeypatch)
    assert isinstance(ours, real) and ours.include_log_monitor is False
    assert parameter.RayParams is real  # restored after the node is made
    # Ray's provider, as shipped, starts one with every node (the default, None = on)
    assert _params_of_a_new_node(FakeMultiNodeProvider, monkeypatch).include_log_monitor \
        in (None, True)


def test_the_cluster_config_names_our_provider_and_it_imports() -> None:
    from ray.autoscaler._private.providers import _get_node_provider_cls

    config = cluster.ClusterSpec(max_nodes=2, node_cpus=2, head_cpus=1).autoscaling_config(
        "127.0.0.1:1", cluster.provider_module())
    assert config["provider"]["module"] == cluster.FAKE_PROVIDER
    # what Ray's autoscaler loads for this config
    assert _get_node_provider_cls(config["provider"]).__name__ == "OneLogMonitorProvider"


@pytest.mark.parametrize(("log_to_driver", "flags"), [
    (None, ["--include-log-monitor=false"]), ("1", [])])
def test_the_head_keeps_its_log_monitor_only_for_a_driver_that_reads_it(
        log_to_driver: str | None, flags: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if log_to_driver is None:
        monkeypatch.delenv("DSV4_LOG_TO_DRIVER", raising=False)
    else:
        monkeypatch.setenv("DSV4_LOG_TO_DRIVER", log_to_driver)
    assert cluster.head_log_monitor_flags() == flags
