"""The node provider of the local multi-node cluster: Ray's fake one, one log monitor per host.

Ray's ``FakeMultiNodeProvider`` starts every worker node's processes with Ray's
defaults, a log monitor among them. All its nodes are this machine and share the head's
session directory, so each extra log monitor tails the same files again: Ray's own
``ray start --include-log-monitor`` help says one per physical host, or drivers see every
line once per node. Each also polls at rest (0.012 cores per node measured,
docs/benchmarks.md §2h) on the cores the engines use. The head keeps the one log monitor
a driver with ``DSV4_LOG_TO_DRIVER=1`` reads (``deployments.local.cluster``).

Loaded by Ray's autoscaler in the head's monitor process (``provider.type: external``);
the touch is ``ray.fake_nodes_one_log_monitor`` in ``deployments/ray_touches/``.
"""

from __future__ import annotations

from typing import Any

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

from deployments.local.ray_params import ray_params_set


class OneLogMonitorProvider(FakeMultiNodeProvider):
    """``FakeMultiNodeProvider`` whose worker nodes start no log monitor of their own."""

    def _create_node_with_resources_and_labels(self, *args: Any, **kwargs: Any) -> Any:
        # the provider holds its lock around the call: one RayParams built at a time
        with ray_params_set(include_log_monitor=False):
            return super()._create_node_with_resources_and_labels(*args, **kwargs)
