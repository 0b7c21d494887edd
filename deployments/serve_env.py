"""The process environment Ray Serve runs with: Ray's high-throughput mode, proxy kept.

Ray Serve reads these flags when each of its processes imports it, so they belong in
the environment of every process Ray starts. ``dsv4-serve run`` sets them in its own
environment before Ray starts (its private cluster, or the ``--nodes`` head and
workers, inherit it); the KubeRay manifests carry them in every Ray container
(``deployments.k8s``). A cluster somebody else started keeps its own environment.

Why (docs/benchmarks.md §2e, measured side by side): ``RAY_SERVE_THROUGHPUT_OPTIMIZED``
(Ray 2.55+, docs.ray.io "Enable High Throughput on Ray Serve") runs user code on the
replica's own event loop, sends requests between Serve processes over gRPC and buffers
request-path logs. Of what that mode switches on, two are switched back:

* direct ingress: every ingress replica would listen on a port of its own, bound as
  ``RAY_SERVE_DEFAULT_HTTP_HOST`` says (all interfaces under HAProxy), beside Serve's
  proxy; the proxy stays the one listener and keeps its ``http_options.host``;
* logs off stderr: replica logs stay where ``ray logs``, users and our tests read them.

A flag the environment already has is kept, never overridden (logged when it differs).
Turning direct ingress or HAProxy on is the operator's choice; the edge then treats
every replica as reachable from the network and requires API keys
(``replicas_listen``, ``deployments.auth``).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SERVE_ENV: dict[str, str] = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_LOG_TO_STDERR": "1",
}
# Either makes each ingress replica listen on its own port (Ray 2.60 constants.py).
LISTEN_FLAGS = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_ENABLE_HA_PROXY")


def apply(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set each ``SERVE_ENV`` flag the environment lacks; one line per flag set or kept
    at another value (nothing for a flag already at ours)."""
    env = os.environ if environ is None else environ
    lines = []
    for name, value in SERVE_ENV.items():
        if name not in env:
            env[name] = value
            lines.append(f"dsv4: Ray Serve env {name}={value} (dsv4-serve default)")
        elif env[name] != value:
            lines.append(f"dsv4: Ray Serve env {name}={env[name]} kept from the environment "
                         f"(dsv4-serve's default is {value})")
    return lines


def listen_requested(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether the environment asks Serve's replicas to listen themselves (a flag at 1),
    read before Ray starts (``dsv4-serve run``'s preflight)."""
    env = os.environ if environ is None else environ
    return any(env.get(name) == "1" for name in LISTEN_FLAGS) or (
        env.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1"
        and env.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") is None)


def replicas_listen() -> bool:
    """Whether Serve in this process runs direct ingress (the replica listens on its own
    port): Serve's own resolved constant (``serve.direct_ingress_flag`` touch)."""
    from ray.serve._private import constants

    return bool(getattr(constants, "RAY_SERVE_ENABLE_DIRECT_INGRESS", False))
