"""The private local Ray cluster of ``dsv4-serve run``: start it, find its endpoints, stop it.

``address="local"`` never attaches to someone else's cluster: ``run`` owns what it
starts and can shut all of it down. Reused by the test session fixture and the
benchmarks, so they boot Ray exactly the way users do.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from deployments import ray_touches, serve_env
from deployments.config import ConfigError, ServeConfig, sizing
from deployments.http import proxy_gate
from deployments.local import ray_token
from deployments.local.ray_params import ray_params_set
from deployments.local.serve_start import ProxiesReady, start_serve
from deployments.logs import get_logger

logger = get_logger("run")


def logical_cpus_needed(config: ServeConfig) -> float:
    """Logical CPUs Ray must offer so every replica of every app can be placed.

    At max_replicas (``deployments.config.sizing.cluster_cpus``).
    """
    return sizing.cluster_cpus([(args.max_replicas_total, args.replica_cpus())
                                for _, args in config.ours()])


@dataclass(frozen=True)
class LocalServe:
    """What ``start_cluster`` started: the logical CPUs Ray offers, and the call that
    waits for Serve's proxies (a no-op unless the start left them to it)."""

    cpus: float
    proxies_ready: ProxiesReady


def start_cluster(config: ServeConfig, num_cpus: float | None = None,
                  metrics_port: int | None = None, address: str | None = None,
                  on_ray_up: Callable[[], object] | None = None,
                  wait_for_proxies: bool = True) -> LocalServe:
    """Start a private local Ray cluster and Serve's HTTP proxy.

    ``address="local"`` never attaches to someone else's cluster: ``run`` owns what
    it starts and can shut all of it down. ``metrics_port`` fixes the port of Ray's
    Prometheus endpoint (``ray.util.metrics``/``ray.serve.metrics`` series, the
    controller's ``ray_dsv4_kv_spec_*`` gauges among them); None takes a free one
    (``metrics_url`` tells which). Ray serves it without the dashboard too, without
    auth, so the node is started on 127.0.0.1 (``loopback_node_ip``): every port Ray
    opens for it, that one included, binds loopback. A cluster at ``address`` (``--nodes``)
    is left as its starter made it. ``on_ray_up()`` is called between Ray's start and
    Serve's (boot phases). ``wait_for_proxies=False`` returns once Serve's controller is
    up: deploy, then call ``proxies_ready()`` before reporting a URL (``serve_start``).
    """
    import ray

    if address is not None:  # a cluster someone else started (--nodes: deployments.local.cluster)
        ray.init(address=address, namespace="serve",
                 log_to_driver=os.environ.get("DSV4_LOG_TO_DRIVER") == "1")
        if on_ray_up is not None:
            on_ray_up()
        return LocalServe(float(ray.cluster_resources().get("CPU", 0)),
                          _start_serve(config, wait_for_proxies))
    needed = logical_cpus_needed(config)
    cpus = num_cpus if num_cpus is not None else max(float(os.cpu_count() or 1), needed)
    if cpus < needed:
        raise ConfigError(
            f"--num-cpus={cpus} but the config needs {needed} logical CPUs at max_replicas "
            "(replica actor + placement-group bundles of every replica). "
            "Fix: raise --num-cpus or lower max_replicas."
        )
    for line in serve_env.apply_local_quiet():  # before Ray starts: its processes inherit it
        logger.info(line)
    # Ray would write ~/.ray/auth_token with the umask's mode: the token is ours, 0600.
    ray_token.use_private_token()
    for line in proxy_gate_env(config.http_options.host):
        logger.info(line)
    if cpus > (os.cpu_count() or 1):
        logger.info("dsv4: offering Ray %s logical CPUs on %s cores: the replicas share them "
                    "(VLLM_CPU_OMP_THREADS_BIND=nobind)", cpus, os.cpu_count())
    log_to_driver = os.environ.get("DSV4_LOG_TO_DRIVER") == "1"
    with loopback_node_ip(), quiet_head(log_to_driver), prompt_node_registration():
        ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                 namespace="serve", log_to_driver=log_to_driver,
                 _metrics_export_port=metrics_port or free_port())
    check_loopback_node()
    if on_ray_up is not None:
        on_ray_up()
    return LocalServe(cpus, _start_serve(config, wait_for_proxies))


def proxy_gate_env(host: str) -> list[str]:
    """Gate Serve's proxy routes (``/-/routes``) with the edge's keys, before Ray starts
    (the proxy actors inherit the env); an operator's own callback is kept and named."""
    if not ray_touches.present("serve.proxy_callback"):
        return ["dsv4: this Ray lacks serve.proxy_callback (deployments/ray_touches/): "
                "Serve's proxy answers /-/routes without a key. Fix: install the pinned Ray."]
    own = os.environ.get(proxy_gate.CALLBACK_ENV)
    if own and own != proxy_gate.CALLBACK:
        return [f"dsv4: {proxy_gate.CALLBACK_ENV}={own} kept from the environment: "
                "Serve's proxy answers /-/routes without a key unless it gates them"]
    os.environ.update(proxy_gate.proxy_gate_env(host))
    return [f"dsv4: Serve's proxy routes (/-/routes) need a key as the edge's do "
            f"({proxy_gate.CALLBACK_ENV}); /-/healthz stays open for probes"]


@contextlib.contextmanager
def loopback_node_ip() -> Iterator[None]:
    """Start the private local node on 127.0.0.1, so every Ray port of it binds loopback.

    Ray 2.60's metrics server (the dashboard agent's Prometheus endpoint, no auth)
    binds all interfaces unless the node IP is loopback, and on Linux
    ``ray.init`` picks the routable IP (``ray_touches``: ``ray.loopback_node_ip``).
    Serve's HTTP proxy is not affected: it binds ``http_options.host``.
    """
    if not ray_touches.present("ray.loopback_node_ip"):
        logger.error("dsv4: this Ray lacks ray.loopback_node_ip (deployments/ray_touches/): "
                     "the local cluster's ports, its metrics endpoint among them, bind every "
                     "interface. Fix: install the pinned Ray, or firewall the node.")
        yield
        return
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@contextlib.contextmanager
def quiet_head(log_to_driver: bool) -> Iterator[None]:
    """Start the private local head without the three daemons it cannot use.

    ``ray.init`` always starts the autoscaler monitor (a fixed one-node cluster has
    nothing to scale), the log monitor (which only forwards worker logs to the
    driver: off unless ``DSV4_LOG_TO_DRIVER=1``) and, with ``include_dashboard=False``,
    a minimal dashboard head whose one module is Ray's usage-stats reporter, which
    ``ray.init`` itself turns off (``RAY_USAGE_STATS_ENABLED=0`` on release wheels).
    Each is a Python process that imports Ray while the head boots (``ray.init`` waits
    for the dashboard head) and polls at rest (docs/benchmarks.md §2g). For the
    duration of ``ray.init`` the ``RayParams`` it builds get ``no_monitor`` and, without
    log forwarding, ``include_log_monitor=False``; the dashboard head is not started
    while usage stats are off (``ray_touches``: ``ray.quiet_local_head``). Logs stay in
    Ray's session directory either way.
    """
    if not ray_touches.present("ray.quiet_local_head"):
        logger.warning("dsv4: this Ray lacks ray.quiet_local_head (deployments/"
                       "ray_touches/): the local head starts its autoscaler and log "
                       "monitors too (more CPU at boot and at rest, nothing lost)")
        yield
        return
    from ray._common.usage import usage_lib
    from ray._private import node

    real_api_server = node.Node.start_api_server
    skipped: list[str] = []
    params = {"no_monitor": True} | ({} if log_to_driver else {"include_log_monitor": False})

    def start_api_server(self: Any, *, include_dashboard: bool | None,
                         raise_on_failure: bool) -> None:
        # Read when ray.init calls it: ray.init has set the usage-stats env by then.
        if include_dashboard or usage_lib.usage_stats_enabled():
            return real_api_server(self, include_dashboard=include_dashboard,
                                   raise_on_failure=raise_on_failure)
        skipped.append("the dashboard head (usage stats are off: its one module)")
        return None

    node.Node.start_api_server = start_api_server
    try:
        with ray_params_set(**params):
            yield
    finally:
        node.Node.start_api_server = real_api_server
    left_out = ["the autoscaler monitor (fixed one-node cluster)"]
    if not log_to_driver:
        left_out.append("the log monitor (no log forwarding to the driver; "
                        "DSV4_LOG_TO_DRIVER=1 keeps it)")
    logger.info("dsv4: local Ray head without %s", ", ".join(left_out + skipped))


REGISTRATION_POLL_S = 0.02


@contextlib.contextmanager
def prompt_node_registration(poll_s: float = REGISTRATION_POLL_S,
                             bound_s: float = 30.0) -> Iterator[None]:
    """Notice the new head's raylet in the GCS within ``poll_s`` of its registering.

    ``ray.init`` starts the raylet, sleeps 0.1 s and asks the GCS for the node
    (``ray._private.services.get_node``); the GCS client behind it sleeps a whole
    second after a miss (C++ ``GlobalStateAccessor::GetNode``; ray#55389 left that
    sleep in place), and the raylet takes ~0.6 s to register here, so every local
    start waited ~1 s for nothing. For the duration of ``ray.init`` ``get_node`` first
    polls the GCS's node table every ``poll_s`` (up to ``bound_s``), then asks the same
    connection Ray's own way (``GlobalState.get_node``, what ``services.get_node``
    calls), which then finds the node at once (``ray_touches``:
    ``ray.prompt_node_registration``).
    """
    if not ray_touches.present("ray.prompt_node_registration"):
        logger.warning("dsv4: this Ray lacks ray.prompt_node_registration (deployments/"
                       "ray_touches/): ray.init may wait ~1 s more for its own raylet")
        yield
        return
    from ray._private import services, state

    real_get_node = services.get_node

    def get_node(gcs_address: str, node_id: str) -> Any:
        table = state.GlobalState()
        table._initialize_global_state(services._get_gcs_client_options(gcs_address))
        started = time.monotonic()
        try:
            while time.monotonic() < started + bound_s and not any(
                    n["NodeID"] == node_id and n["Alive"] for n in table.node_table()):
                time.sleep(poll_s)
            logger.info("dsv4: the head's raylet was in the GCS %.2f s after Ray first "
                        "asked (polled every %d ms)", time.monotonic() - started,
                        poll_s * 1000)
            return table.get_node(node_id)  # Ray's own answer, errors included
        finally:
            table.disconnect()

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = real_get_node


def check_loopback_node() -> None:
    """Log an ERROR when the local node (and so its metrics port) is not on loopback."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    [node] = [n for n in ray.nodes() if n["NodeID"] == node_id]
    address = node["NodeManagerAddress"]
    try:
        loopback = ipaddress.ip_address(address).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        logger.error("dsv4: the local Ray node is on %s, not loopback: its ports, the "
                     "metrics endpoint (port %s, no auth) among them, answer beyond this "
                     "machine. Fix: firewall them, or report this Ray version.", address,
                     node["MetricsExportPort"])


def _start_serve(config: ServeConfig, wait_for_proxies: bool) -> ProxiesReady:
    extra = config.model_extra or {}
    return start_serve(config.http_options.model_dump(),
                       extra.get("proxy_location", "HeadOnly"), wait_for_proxies)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now.

    Passed to Ray explicitly so the port is ours to know and print (Ray's own
    default, 0, leaves the choice to its metrics agent).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def gcs_reachable(timeout_s: float = 2.0) -> bool:
    """Whether this driver's GCS still accepts TCP connections (no RPC, no waiting).

    Serve and Ray calls against a dead GCS block for ~60 s, after which Ray ends
    the driver with "Failed to connect to GCS within 60 seconds".
    """
    import ray

    host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def metrics_url() -> str:
    """Ray's Prometheus endpoint on this node (the local cluster has one node).

    Series appear there one metrics report interval (~10 s) after they are set.
    """
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    [node] = [n for n in ray.nodes() if n["NodeID"] == node_id]
    return f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"


def shutdown() -> None:
    """Stop Serve (proxies, controller, whatever replicas remain), then Ray.

    Run ``drain`` first to let in-flight requests finish.
    """
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
