"""Ray Serve's process-environment flags: who can reach a replica, and the throughput mode.

Serve reads these when each of its processes imports it, so they live in the
environment of every process Ray starts (``ray start``, a pod's env); dsv4-serve sets
them only for the door a config asks for (``http.ingress: haproxy``: ``apply_ingress``
before its own local Ray starts, ``k8s.params.ingress_env`` on KubeRay pods) and for
a quiet local head (``apply_local_quiet``). Two things depend on them:

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
# (MIN, MAX) of Serve's direct-ingress HTTP ports (``direct_ingress_range``).
DIRECT_RANGE_FLAGS = ("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT",
                      "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT")
DIRECT_FLAGS = ("RAY_SERVE_ENABLE_DIRECT_INGRESS", *DIRECT_RANGE_FLAGS)


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
# ``deployments.local.ray_head.start_cluster`` and the local multi-node cluster of
# ``--nodes`` (``deployments.local.cluster``) start (never for a cluster someone else
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


# ``http.ingress: haproxy`` (issue 34): Ray 2.60's HAProxy ingress on http_options.port,
# forwarding to each ingress replica's direct-ingress port, HAProxy itself run through
# ``dsv4-haproxy`` (deployments/doors/haproxy.py: its stats page and Prometheus exporter
# on 127.0.0.1, the admin socket mode 600). Serve's proxy stays up on
# RAY_SERVE_FALLBACK_PROXY_HTTP_PORT (8500) as HAProxy's backup server.
HAPROXY_FLAG = "RAY_SERVE_ENABLE_HA_PROXY"
HAPROXY_BINARY_FLAG = "RAY_SERVE_HAPROXY_BINARY_PATH"
HAPROXY_WRAPPER = "dsv4-haproxy"


def haproxy_binary() -> str:
    """The absolute path of ``dsv4-haproxy`` beside this Python (Ray wants an absolute
    path), else the one on PATH; ValueError when neither exists."""
    import shutil
    import sys
    from pathlib import Path

    beside = Path(sys.executable).with_name(HAPROXY_WRAPPER)
    found = str(beside) if beside.exists() else shutil.which(HAPROXY_WRAPPER)
    if not found:
        raise ValueError(f"{HAPROXY_WRAPPER} is not installed beside {sys.executable} nor on "
                         "PATH. Fix: pip install dsv4-serve in this environment.")
    return str(Path(found).absolute())


def haproxy_env(binary: str) -> dict[str, str]:
    """The flags every Ray process needs for ``http.ingress: haproxy``."""
    return {HAPROXY_FLAG: "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            HAPROXY_BINARY_FLAG: binary}


# One HAProxy thread, not Ray's 4: HAProxy forwards each streamed SSE chunk by itself,
# and threads that each wake for fewer chunks pay more per chunk. On Ray's own rendered
# config (benchmarks/haproxy_threads.py; docs/benchmarks.md §2j, "HAProxy's thread
# count"), one thread cost 29-43 % less CPU per chunk than four with 6 to 64 streams,
# from a CPU engine's rate to an 8-GPU node's 20,000 chunks/s, the same with one stream,
# and carried the node's rate over 64 streams on 0.22 of a core. Each node's HAProxy
# carries that node's share of the traffic; an ingress that carries several nodes'
# raises it (a value already in the environment wins and is named).
# Session affinity: HAProxy hashes Serve's session header (x-session-id) onto the replica
# ports, consistently and with bounded loads (deployments/doors/haproxy.py adds both), so a
# conversation's turns find their prefix in one replica's KV cache; requests without it
# go round robin (Ray's default is leastconn). A drained or engine-dead replica fails the
# health check HAProxy polls and leaves the ring.
HAPROXY_TUNING: dict[str, str] = {"RAY_SERVE_HAPROXY_NBTHREAD": "1",
                                  "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": "hdr(x-session-id)"}
HAPROXY_TUNING_WHY = {"RAY_SERVE_HAPROXY_NBTHREAD": "one HAProxy thread: less CPU per "
                      "streamed chunk", "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM": "session affinity:"
                      " a conversation's turns to one replica's KV cache, by x-session-id"}


def ingress_tuning() -> dict[str, str]:
    """Flags for ``http.ingress: haproxy`` that are ours, not needed: ``HAPROXY_TUNING``."""
    return dict(HAPROXY_TUNING)


def apply_ingress(ingress: str, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Before our own local Ray starts: the flags ``ingress`` needs (none for Serve's
    proxy), HAProxy's threads and balance (``HAPROXY_TUNING``) and the local drain
    window (``local_drain_env``); one line per flag set or kept, with its reason."""
    if ingress != "haproxy":
        return []
    env = os.environ if environ is None else environ
    lines = _set_missing(haproxy_env(haproxy_binary()), "http.ingress: haproxy",
                         "http.ingress: haproxy needs", env)
    for name, value in ingress_tuning().items():
        lines += _set_missing({name: value}, HAPROXY_TUNING_WHY[name],
                              "dsv4-serve's default is", env)
    down_s = haproxy_down_s(env)
    return lines + _set_missing(
        local_drain_env(env), f"local run: twice the {down_s:g} s this host's HAProxy takes "
        "to mark a draining replica down", "a local run's default is", env)


# A stopping direct-ingress replica keeps accepting for DRAIN_FLAG seconds while it fails
# HAProxy's health check, so the balancer in front takes it out before its port closes
# (Ray 2.60 replica.py ``_drain_behind_haproxy``). Ray's 30 s is sized for an external
# balancer (an ALB deregistering a target). In a local run the only balancer in front of
# the replica ports is this host's HAProxy, which marks a failing server down after its
# check period plus (fall - 1) fast checks: 5.25 s at Ray's defaults (below; Ray 2.60
# constants.py, compared with the installed Ray by tests). The local window is twice
# that, so a check delayed on a busy box still lands inside it; every local stop and
# scale-down under HAProxy is ~20 s shorter. KubeRay keeps Ray's 30 s (its pods sit
# behind a Service and whatever balancer the operator puts in front).
DRAIN_FLAG = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
HAPROXY_CHECK_DEFAULTS = {"RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER": "5s",
                          "RAY_SERVE_HAPROXY_HEALTH_CHECK_FASTINTER": "250ms",
                          "RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL": "2"}
_HAPROXY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def haproxy_time_s(value: str) -> float:
    """An HAProxy time (``5s``, ``250ms``; a bare number is milliseconds) in seconds."""
    text = value.strip()
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(digits):] or "ms"
    if not digits or unit not in _HAPROXY_UNITS:
        raise ValueError(f"HAProxy time {value!r}: expected a number with one of "
                         f"{sorted(_HAPROXY_UNITS)} (e.g. 5s, 250ms). Fix: correct it.")
    return float(digits) * _HAPROXY_UNITS[unit]


def haproxy_down_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds HAProxy takes, at most, to mark a server that starts failing its check
    down: one check period, then ``fall - 1`` fast checks (this environment's values,
    Ray's defaults otherwise)."""
    env = os.environ if environ is None else environ
    value = {name: env.get(name, default) for name, default in HAPROXY_CHECK_DEFAULTS.items()}
    fall_text = value["RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL"]
    if not fall_text.strip().isdigit():
        raise ValueError(f"RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL={fall_text!r}: expected a "
                         "whole number of failed checks (Ray's default 2). Fix: correct it.")
    fall = int(fall_text)
    return (haproxy_time_s(value["RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER"])
            + max(fall - 1, 0) * haproxy_time_s(value["RAY_SERVE_HAPROXY_HEALTH_CHECK_FASTINTER"]))


def local_drain_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The local run's direct-ingress drain window: twice ``haproxy_down_s``."""
    return {DRAIN_FLAG: f"{2 * haproxy_down_s(environ):g}"}


def ingress_problem(ingress: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Whether the Ray this app is built in runs the door the config asks for, read from
    the building process's environment (every Ray process has the cluster's): None, or
    what differs and the fix. Never silently: a config saying one door while the cluster
    runs the other would leave drain or the side-door hardening off."""
    env = os.environ if environ is None else environ
    on = env.get(HAPROXY_FLAG) == "1"
    if ingress == "haproxy" and not on:
        return (f"http.ingress=haproxy but this Ray cluster runs without {HAPROXY_FLAG}=1. "
                f"Fix: set {HAPROXY_FLAG}=1, RAY_SERVE_ENABLE_DIRECT_INGRESS=1 and "
                f"{HAPROXY_BINARY_FLAG}=<abs path of {HAPROXY_WRAPPER}> in every Ray "
                "process's environment (`dsv4-serve run` and `dsv4-serve k8s render` do), "
                "or set http.ingress: serve_proxy.")
    if ingress != "haproxy" and on:
        return (f"http.ingress={ingress} but this Ray cluster runs {HAPROXY_FLAG}=1: HAProxy "
                "would be the door, without the KV-spec drain of Serve's router. Fix: set "
                "http.ingress: haproxy, or unset the flag.")
    if on:
        try:
            haproxy_target(env)
            direct_ingress_range(env)
        except ValueError as exc:
            return str(exc)
    if on and not env.get(HAPROXY_BINARY_FLAG, "").endswith(HAPROXY_WRAPPER):
        return (f"http.ingress=haproxy but {HAPROXY_BINARY_FLAG}="
                f"{env.get(HAPROXY_BINARY_FLAG, '')!r}: HAProxy's stats page and Prometheus "
                f"exporter would answer on every interface. Fix: point it at "
                f"{HAPROXY_WRAPPER} (absolute path).")
    return None


# The ports HAProxy's cluster opens beside http_options.port (Ray 2.60's defaults).
HAPROXY_SIDE_PORTS = {"RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 8500,
                      "RAY_SERVE_HAPROXY_STATS_PORT": 8404,
                      "RAY_SERVE_HAPROXY_METRICS_PORT": 9101}


def haproxy_ports_beside(door: int, replicas: int) -> dict[str, str]:
    """The HAProxy cluster's other ports next to its ``door``, so several clusters share
    one machine (tests, benchmarks): the fallback proxy, stats and Prometheus frontends
    at door+1..3, and ``replicas`` direct-ingress ports from door+10."""
    side = dict(zip(HAPROXY_SIDE_PORTS, (door + 1, door + 2, door + 3), strict=True))
    side |= dict(zip(DIRECT_RANGE_FLAGS, (door + 10, door + 10 + replicas), strict=True))
    return {name: str(port) for name, port in side.items()}


# Under HAProxy each ingress replica answers on a port of its own beside Ray's
# direct-ingress port, its Ray port plus the span of Ray's range (``replica_port_for``):
# ``dsv4-haproxy`` points HAProxy's servers there (deployments.doors.haproxy) and the
# replica binds it (deployments.doors.haproxy_target). Serve's allocator hands out
# range(MIN, MAX) (Ray 2.60 node_port_manager), so these ports run from MAX to
# 2*MAX-MIN-1: 31000-31999 at Ray's defaults.
DIRECT_RANGE_DEFAULTS = (30000, 31000)


# Where dsv4-haproxy sends HAProxy: ``replica`` (the default), each replica's own port on
# its app loop; ``ray``, Ray's direct-ingress ports as Ray configured them (a cluster
# that also serves apps other than dsv4-serve's, or a same-run comparison). Cluster-wide,
# like Ray's flags: read by dsv4-haproxy and by each replica.
HAPROXY_TARGET_FLAG = "DSV4_HAPROXY_TARGET"
HAPROXY_TARGETS = ("replica", "ray")


def haproxy_target(environ: Mapping[str, str] | None = None) -> str:
    """``DSV4_HAPROXY_TARGET`` in this environment (``replica`` unless set); ValueError
    naming the flag for another value."""
    env = os.environ if environ is None else environ
    value = env.get(HAPROXY_TARGET_FLAG, HAPROXY_TARGETS[0]).strip() or HAPROXY_TARGETS[0]
    if value not in HAPROXY_TARGETS:
        raise ValueError(f"{HAPROXY_TARGET_FLAG}={value!r}: expected one of "
                         f"{', '.join(HAPROXY_TARGETS)}. Fix: unset it (each replica's own "
                         "port) or set ray (Ray's direct-ingress ports).")
    return value


def direct_ingress_range(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(MIN, MAX) of Serve's direct-ingress HTTP ports in this environment (Ray's
    defaults otherwise); ValueError naming the flag when it is not a port range."""
    env = os.environ if environ is None else environ
    bounds = []
    for name, default in zip(DIRECT_RANGE_FLAGS, DIRECT_RANGE_DEFAULTS, strict=True):
        text = env.get(name, str(default)).strip()
        if not text.isdigit():
            raise ValueError(f"{name}={text!r}: expected a port number. Fix: correct it.")
        bounds.append(int(text))
    low, high = bounds
    if not 0 < low < high <= 65535 or 2 * high - low - 1 > 65535:
        raise ValueError(f"{DIRECT_RANGE_FLAGS[0]}={low}, {DIRECT_RANGE_FLAGS[1]}={high}: "
                         "expected MIN < MAX and the replicas' own ports (MAX to 2*MAX-MIN-1) "
                         "below 65536. Fix: pick a lower or narrower range.")
    return low, high


def replica_port_for(ray_port: int, environ: Mapping[str, str] | None = None) -> int | None:
    """The replica's own port behind HAProxy for Ray's direct-ingress ``ray_port``, or
    None when ``ray_port`` is not one Serve hands out in this environment."""
    return own_port(ray_port, direct_ingress_range(environ))


def own_port(ray_port: int, direct: tuple[int, int]) -> int | None:
    """``replica_port_for`` over an already-read ``(MIN, MAX)`` range."""
    low, high = direct
    return ray_port + (high - low) if low <= ray_port < high else None


def haproxy_side_ports(environ: Mapping[str, str] | None = None) -> list[tuple[str, int]]:
    """(flag, port) of Serve's fallback proxy and HAProxy's stats and Prometheus
    frontends, as this environment sets them."""
    env = os.environ if environ is None else environ
    return [(name, int(env.get(name, default))) for name, default in HAPROXY_SIDE_PORTS.items()]
