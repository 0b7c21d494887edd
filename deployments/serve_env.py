"""Ray Serve's process-environment flags: who can reach a replica, and the throughput mode.

Serve reads these when each of its processes imports it, so they live in the
environment of every process Ray starts (``ray start``, a pod's env); dsv4-serve sets
none of them (Ray's defaults). Two things depend on them:

* **Who can connect.** ``RAY_SERVE_ENABLE_DIRECT_INGRESS=1`` or
  ``RAY_SERVE_ENABLE_HA_PROXY=1`` (and ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, which
  switches direct ingress on unless it is set) make every ingress replica listen on a
  port of its own beside Serve's proxy, bound as ``RAY_SERVE_DEFAULT_HTTP_HOST`` says
  (all interfaces under HAProxy, its stats page too). Then ``http_options.host`` no
  longer bounds who connects, and ``run``'s preflight (``listen_requested``) and each
  replica's edge (``replicas_listen``) require an API key even on 127.0.0.1.
* **The throughput mode, opt-in.** ``SERVE_ENV`` is Ray's documented high-throughput
  mode (docs.ray.io "Enable High Throughput on Ray Serve", Ray 2.55+: user code on the
  replica's own event loop, gRPC between Serve processes, buffered request logs) with
  direct ingress switched back off, so the proxy stays the one listener, and logs kept
  on stderr. Measured side by side on 2 CPU cores (docs/benchmarks.md §2e) it made no
  difference beyond the box's noise, so it is not the default; the benchmark's
  ``ours-tput`` arm applies it (``apply``), and an operator can export the three flags
  before ``ray start``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

SERVE_ENV: dict[str, str] = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_LOG_TO_STDERR": "1",
}
# Direct ingress pinned to one port (benchmarks.serving_overhead's ours-direct arm):
# Serve's allocator hands out range(MIN, MAX) (Ray 2.60 node_port_manager.PortAllocator),
# so MIN=p, MAX=p+1 gives the one replica port p; the replica binds it on
# http_options.host (replica._maybe_start_direct_ingress_servers), 127.0.0.1 locally.
DIRECT_FLAGS = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
                "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT")


def direct_env(port: int) -> dict[str, str]:
    """Serve's direct ingress with its one HTTP port at ``port`` (one replica)."""
    return dict(zip(DIRECT_FLAGS, ("1", str(port), str(port + 1)), strict=True))


# Either makes each ingress replica listen on its own port (Ray 2.60 constants.py).
LISTEN_FLAGS = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_ENABLE_HA_PROXY")


def apply(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set each ``SERVE_ENV`` flag the environment lacks (before Ray starts); one line
    per flag set, or kept at another value (nothing for a flag already at ours)."""
    return _set_missing(SERVE_ENV, "throughput mode", "the throughput mode's is", environ)


def _set_missing(flags: Mapping[str, str], why: str, ours: str,
                 environ: MutableMapping[str, str] | None) -> list[str]:
    """Set each of ``flags`` the environment lacks; a value already there wins and is
    named. One line per flag set or kept (nothing for a flag already at ours)."""
    env = os.environ if environ is None else environ
    lines = []
    for name, value in flags.items():
        if name not in env:
            env[name] = value
            lines.append(f"dsv4: Ray Serve env {name}={value} ({why})")
        elif env[name] != value:
            lines.append(f"dsv4: Ray Serve env {name}={env[name]} kept from the environment "
                         f"({ours} {value})")
    return lines


# A local run idles quietly (issue 25, docs/benchmarks.md §2f): Serve's settings that
# only cost CPU at rest on one machine, slowed for the private local Ray that
# ``deployments.local.ray_head.start_cluster`` starts (never for a cluster someone else
# started, nor the KubeRay presets). Measured idle, per process, on 2 cores:
# * the Serve controller's control loop runs every 0.1 s (``CONTROL_LOOP_INTERVAL_S``):
#   4.3 % of a core at rest; at 0.5 s a deployment change or an autoscaling decision is
#   seen up to 0.4 s later (metrics arrive every 10 s anyway);
# * every Serve replica, proxy and router flushes its cached request metrics to Ray's
#   metric API every 0.1 s (``RAY_SERVE_METRICS_EXPORT_INTERVAL_MS``); Ray exports them
#   to Prometheus every 10 s, so 1 s loses no series and no count.
LOCAL_QUIET_ENV: dict[str, str] = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}


def apply_local_quiet(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Set each ``LOCAL_QUIET_ENV`` flag the environment lacks, before the local Ray
    starts (its processes inherit it); one line per flag, set or kept: a user's own
    value always wins and is named."""
    return _set_missing(LOCAL_QUIET_ENV, "local run, quiet at rest",
                        "a local run's default is", environ)


def listen_requested(environ: Mapping[str, str] | None = None) -> bool:
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
