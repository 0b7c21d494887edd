"""``dsv4-serve run [CONFIG]``: the whole stack on this machine, until Ctrl-C.

Validates the config (before anything starts), builds the tiny model if the
config serves it, starts a private local Ray cluster, deploys the Serve
application(s), waits until the KV-spec controller has a verdict, sends one
request to prove a token comes out, prints the OpenAI base URL and the
consensus, and on Ctrl-C/SIGTERM drains: the applications stop taking new
requests, in-flight ones run to their end (bounded by the replicas'
``graceful_shutdown_timeout_s``), the replicas stop their vLLM engines, then Serve
and Ray shut down.

The functions are reused by the test session fixture, so the tests boot the
stack exactly the way users do.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deployments.config import DEFAULT_CONFIG, AppArgs, ConfigError, ServeConfig, load_serve_config

if TYPE_CHECKING:
    from deployments.cluster import LocalCluster

logger = logging.getLogger("dsv4_serve.run")

INGRESS_CPUS = 1.0  # Ray Serve LLM's OpenAI ingress default


@dataclass
class Timings:
    """Seconds since ``dsv4-serve run`` started, per milestone (printed and tested)."""

    start: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> float:
        self.marks[name] = round(time.monotonic() - self.start, 1)
        return self.marks[name]


def logical_cpus_needed(config: ServeConfig) -> float:
    """Logical CPUs Ray must offer so every replica of every app can be placed.

    Ray Serve LLM puts the replica actor (1 CPU unless ray_actor_options says
    otherwise) into the first placement-group bundle; the engine workers take
    the bundles. At max_replicas, plus one ingress per application.
    """
    total = 0.0
    for _, args in config.ours():
        total += INGRESS_CPUS + args.llm.deployment_config.max_replicas * replica_cpus(args)
    return total


def replica_cpus(args: AppArgs) -> float:
    """CPUs of one replica: its actor plus its engine workers' bundles."""
    actor_opts = (args.llm.deployment_config.model_extra or {}).get("ray_actor_options") or {}
    pg = args.llm.placement_group_config
    bundles = sum(b.get("CPU", 0) for b in pg.bundles) if pg else 1.0
    return float(actor_opts.get("num_cpus", 1)) + bundles


def base_url(config: ServeConfig, route_prefix: str | None = "/") -> str:
    """The OpenAI base URL of an application (clients append /chat/completions etc.)."""
    http = config.http_options
    prefix = (route_prefix or "/").rstrip("/")
    return f"http://{http.host}:{http.port}{prefix}/v1"


def start_cluster(config: ServeConfig, num_cpus: float | None = None,
                  metrics_port: int | None = None, address: str | None = None) -> float:
    """Start a private local Ray cluster and Serve's HTTP proxy; return the CPUs given.

    ``address="local"`` never attaches to someone else's cluster: ``run`` owns what
    it starts and can shut all of it down. ``metrics_port`` fixes the port of Ray's
    Prometheus endpoint (``ray.util.metrics``/``ray.serve.metrics`` series, the
    controller's ``ray_dsv4_kv_spec_*`` gauges among them); None takes a free one
    (``metrics_url`` tells which). Ray serves it without the dashboard too.
    """
    import ray

    if address is not None:  # a cluster someone else started (--nodes: deployments.cluster)
        ray.init(address=address, namespace="serve",
                 log_to_driver=os.environ.get("DSV4_LOG_TO_DRIVER") == "1")
        _start_serve(config)
        return float(ray.cluster_resources().get("CPU", 0))
    needed = logical_cpus_needed(config)
    cpus = num_cpus if num_cpus is not None else max(float(os.cpu_count() or 1), needed)
    if cpus < needed:
        raise ConfigError(
            f"--num-cpus={cpus} but the config needs {needed} logical CPUs at max_replicas "
            f"(replica actor + placement-group bundles, plus {INGRESS_CPUS} per ingress). "
            "Fix: raise --num-cpus or lower max_replicas."
        )
    if cpus > (os.cpu_count() or 1):
        logger.info("dsv4: offering Ray %s logical CPUs on %s cores: the replicas share them "
                    "(VLLM_CPU_OMP_THREADS_BIND=nobind)", cpus, os.cpu_count())
    ray.init(address="local", num_cpus=cpus, include_dashboard=False,
             namespace="serve", log_to_driver=os.environ.get("DSV4_LOG_TO_DRIVER") == "1",
             _metrics_export_port=metrics_port or free_port())
    _start_serve(config)
    return cpus


def _start_serve(config: ServeConfig) -> None:
    from ray import serve

    extra = config.model_extra or {}
    serve.start(http_options=config.http_options.model_dump(),
                proxy_location=extra.get("proxy_location", "HeadOnly"))


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


def deploy(config: ServeConfig, timings: Timings | None = None) -> dict[str, float]:
    """Deploy every application of ours; return seconds until each was RUNNING."""
    from ray import serve

    from deployments.app import build_app

    others = [a.name for a in config.applications if not a.is_ours]
    if others:
        raise ConfigError(
            f"applications {others} use another import_path; `dsv4-serve run` deploys only "
            "deployments.app:build_app. Fix: deploy the file with `serve deploy`."
        )
    seconds = {}
    for app, _ in config.ours():
        started = time.monotonic()
        serve.run(build_app(app.args), name=app.name, route_prefix=app.route_prefix)
        seconds[app.name] = round(time.monotonic() - started, 1)
        if timings:
            timings.mark(f"app {app.name} RUNNING")
    return seconds


def http_json(url: str, method: str = "GET", body: dict[str, Any] | None = None,
              timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) for a request; HTTP errors are answers, not exceptions."""
    data = None if body is None else json.dumps(body).encode()
    from deployments.auth import client_headers

    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          **client_headers()})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def wait_for_verdict(url: str, timeout_s: float = 300.0) -> dict[str, Any]:
    """Poll ``/v1/kv-spec?refresh=true`` until the verdict is not ``incomplete``."""
    deadline = time.monotonic() + timeout_s
    report: dict[str, Any] = {}
    while time.monotonic() < deadline:
        _, report = http_json(f"{url}/kv-spec?refresh=true")
        if report.get("state") in ("agree", "disagree"):
            return report
        time.sleep(2)
    raise TimeoutError(f"no KV-spec verdict after {timeout_s}s; last report: {report}")


def first_token(url: str, model: str) -> float:
    """Seconds for one 1-token completion: proof that a token comes out."""
    started = time.monotonic()
    status, body = http_json(f"{url}/completions", "POST",
                             {"model": model, "prompt": "Hello", "max_tokens": 1},
                             timeout=300)
    if status != 200:
        raise RuntimeError(f"first request failed with HTTP {status}: {body}")
    return round(time.monotonic() - started, 2)


DRAIN_POLL_S = 0.5
# Serve's controller force-stops a replica at the end of its grace period; give it
# this long to do so before serve.shutdown() takes over.
DRAIN_MARGIN_S = 10.0


def drain_deadline_s(config: ServeConfig) -> float:
    """The longest our apps may take to drain: the ingress's grace period plus a margin."""
    from deployments.app import ingress_drain_timeout_s

    longest = max((ingress_drain_timeout_s(args) for _, args in config.ours()), default=0.0)
    return longest + DRAIN_MARGIN_S


def in_flight_requests(app_names: list[str]) -> int:
    """Requests the apps' serving replicas are handling now (every client request
    passes exactly one: they are the ingress), read from the replica actors; 0 once
    they have stopped."""
    import ray
    from ray.serve._private.common import ReplicaID

    from deployments.app import serves_http

    handles = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if not ReplicaID.is_full_id_str(actor["name"]):
            continue
        replica = ReplicaID.from_full_id_str(actor["name"]).deployment_id
        if replica.app_name in app_names and serves_http(replica.name):
            handles.append(ray.get_actor(actor["name"], namespace=actor["namespace"]))
    counts = ray.get([h.get_num_ongoing_requests.remote() for h in handles], timeout=10)
    return int(sum(counts))


def drain(timeout_s: float) -> None:
    """Stop taking new requests and let in-flight ones finish, for at most ``timeout_s``.

    ``serve.shutdown()`` alone stops the HTTP proxies together with the replicas,
    so streams in flight are cut within a fraction of a second. Deleting the
    applications first removes their routes (new requests get 404) while the
    proxies keep relaying what is in flight; each replica waits for its requests
    up to its ``graceful_shutdown_timeout_s`` (set by ``build_app``), then stops
    (servers stop their vLLM engines). A second Ctrl-C/SIGTERM skips the wait.
    """
    from ray import serve

    apps = list(serve.status().applications)
    if not apps:
        return
    started = time.monotonic()
    try:
        count: int | str = in_flight_requests(apps)
    except Exception as exc:  # the count is for people; the drain goes on without it
        count = "an unknown number of"
        logger.warning("dsv4: could not count in-flight requests: %r", exc)
    print(f"draining {count} in-flight request(s) of {apps} (at most {timeout_s:.0f} s; "
          "new requests get 404)...", file=sys.stderr, flush=True)
    for name in apps:
        serve.delete(name, _blocking=False)
    while set(apps) & set(serve.status().applications):
        if time.monotonic() - started > timeout_s:
            print(f"drain: {apps} still stopping after {timeout_s:.0f} s; "
                  "shutting down anyway", file=sys.stderr, flush=True)
            return
        time.sleep(DRAIN_POLL_S)
    print(f"drained in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)


GCS_POLL_S = 0.5


def drain_while_cluster_lives(timeout_s: float) -> bool:
    """``drain`` in a thread, watched: False as soon as the GCS is gone.

    A process-group SIGTERM (``kill -TERM -PGID``, systemd's ``KillMode=control-group``)
    stops gcs_server and the raylet together with us, possibly while the drain is
    under way; a Serve call then blocks for 60 s before Ray ends this process with
    an error. Nothing is left to drain then: the replicas died with the raylet and
    their engines with them (``dsv4_patch.lifetime``). A second signal stops waiting.
    """
    worker = threading.Thread(target=drain, args=(timeout_s,), name="dsv4-drain", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(GCS_POLL_S)
            if worker.is_alive() and not gcs_reachable():
                return False
    except KeyboardInterrupt:
        print("second signal: not waiting for in-flight requests", file=sys.stderr,
              flush=True)
    return True


def shutdown() -> None:
    """Stop Serve (proxies, controller, whatever replicas remain), then Ray.

    Run ``drain`` first to let in-flight requests finish.
    """
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


def describe(report: dict[str, Any]) -> str:
    """The consensus in a few lines, for people (``deployments.status.describe``)."""
    from deployments.status import describe as describe_report
    from deployments.wire import FleetReport

    return describe_report(FleetReport.model_validate(report))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", type=Path, default=DEFAULT_CONFIG,
                        help=f"Serve config YAML (default: {DEFAULT_CONFIG})")
    parser.add_argument("--num-cpus", type=float, default=None,
                        help="logical CPUs for the local Ray (default: enough for "
                        "max_replicas, at least the core count)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="port of Ray's Prometheus metrics endpoint (default: a "
                        "free one; the URL is printed)")
    parser.add_argument("--no-smoke", action="store_true",
                        help="skip the one-token request after deploying")
    parser.add_argument("--nodes", type=int, default=None, metavar="N",
                        help="a local multi-node cluster instead of one node: a head that "
                        "takes no replicas and up to N worker nodes (separate raylets, each "
                        "standing in for a GPU node) added and removed by Ray's autoscaler; "
                        "one replica per node")
    parser.add_argument("--node-idle-timeout-s", type=float, default=60.0,
                        help="with --nodes: seconds a worker node may sit idle before the "
                        "autoscaler removes it (default: %(default)s)")


@dataclass
class StopSignal:
    """Set by Ctrl-C/SIGTERM. While serving it ends the wait loop; while booting it
    aborts the boot (KeyboardInterrupt). Either way ``main`` drains and shuts Serve
    and Ray down; a second signal while draining stops waiting (KeyboardInterrupt)."""

    event: threading.Event = field(default_factory=threading.Event)
    serving: bool = False
    draining: bool = False

    def install(self) -> StopSignal:
        signal.signal(signal.SIGINT, self._handler)
        signal.signal(signal.SIGTERM, self._handler)
        return self

    def _handler(self, signum: int, _frame: Any) -> None:
        print(f"\n{signal.Signals(signum).name}: shutting down...", file=sys.stderr)
        first = not self.event.is_set()
        self.event.set()
        if (first and not self.serving) or (not first and self.draining):
            raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    """Deploy, report, serve until a signal, shut down."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    timings = Timings()
    try:
        config = load_serve_config(args.config)
        from deployments.auth import preflight

        preflight(config)  # refuses a reachable bind without an API key, before Ray starts
    except ConfigError as exc:
        print(f"dsv4-serve run: {exc}", file=sys.stderr)
        return 2
    stop = StopSignal().install()
    nodes: LocalCluster | None = None
    try:
        if args.nodes is not None:
            nodes = start_nodes(config, args)
            timings.mark("head up")
        start_cluster(config, args.num_cpus, args.metrics_port,
                      address=nodes.address if nodes else None)
        # ray.init replaces the SIGTERM handler with one that kills Ray's processes and
        # exits 1, skipping Serve's drain (replicas never stop their vLLM engines). Ours
        # again: SIGTERM then takes the same clean path as Ctrl-C.
        stop.install()
        timings.mark("ray+serve up")
        deploy(config, timings)
        for app, parsed in config.ours():
            url = base_url(config, app.route_prefix)
            report = wait_for_verdict(url)
            print(f"[{app.name}] OpenAI base URL: {url}  (after {timings.mark('verdict')} s)")
            print(describe(report))
            if not args.no_smoke:
                latency = first_token(url, parsed.llm.model_loading_config.model_id)
                print(f"[{app.name}] first token after {timings.mark('first token')} s "
                      f"(request latency {latency} s)")
        print(f"Prometheus metrics: {metrics_url()}")
        stop.serving = True
        print("Serving; Ctrl-C to stop.", flush=True)
        while not stop.event.wait(1.0):
            pass
        return 0
    except ConfigError as exc:
        print(f"dsv4-serve run: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dsv4-serve run: interrupted while starting", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError) as exc:
        # Serve's "Deploying application ... failed" carries the replica's own error
        # (e.g. KVLayoutMismatch with its fix); print it without a Python traceback.
        print(f"dsv4-serve run: {exc}", file=sys.stderr)
        return 1
    finally:
        try:
            stop_everything(stop, config)
        finally:
            if nodes is not None:
                nodes.stop()
        print(f"stopped after {timings.mark('stopped')} s", file=sys.stderr)


def start_nodes(config: ServeConfig, args: argparse.Namespace) -> LocalCluster:
    """``--nodes N``: place one replica per worker node and start the cluster's head.

    Worker nodes come later, from the autoscaler, as the replicas ask for them.
    """
    from deployments import cluster

    if args.nodes < 1:
        raise ConfigError(f"--nodes={args.nodes}: expected at least 1 worker node. Fix: "
                          "--nodes 2, or leave it out for the one-node cluster.")
    if args.num_cpus is not None or args.metrics_port is not None:
        raise ConfigError("--num-cpus and --metrics-port apply to the one-node cluster; with "
                          "--nodes each worker node gets one replica's CPUs. Fix: drop them.")
    ours = config.ours()
    for app, parsed in ours:
        top = parsed.llm.deployment_config.max_replicas
        if top > args.nodes:
            raise ConfigError(
                f"applications[{app.name}] max_replicas={top} but --nodes={args.nodes}: "
                "one replica per node. Fix: --nodes "
                f"{top}, or lower autoscaling_config.max_replicas.")
    try:
        changes = cluster.place_one_replica_per_node([app.args for app, _ in ours])
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    for change in changes:
        logger.info("dsv4: --nodes: %s", change)
    spec = cluster.ClusterSpec(
        max_nodes=args.nodes,
        node_cpus=max(replica_cpus(parsed) for _, parsed in config.ours()),
        head_cpus=INGRESS_CPUS * len(ours),
        idle_timeout_s=args.node_idle_timeout_s,
    )
    return cluster.LocalCluster.start(spec)


def stop_everything(stop: StopSignal, config: ServeConfig) -> None:
    """Drain (only a stack that served has requests worth waiting for), then shut down.

    Shutdown runs even if the drain fails, so no Ray or vLLM process outlives ``run``.
    When the GCS is already gone (see ``drain_while_cluster_lives``), Serve cannot be
    asked anything: only Ray's own processes are stopped.
    """
    import ray

    if not ray.is_initialized():
        return
    stop.draining = stop.serving
    cluster_alive = gcs_reachable()
    try:
        if stop.draining and cluster_alive:
            cluster_alive = drain_while_cluster_lives(drain_deadline_s(config))
    finally:
        stop.draining = False
        if cluster_alive and gcs_reachable():
            shutdown()
        else:
            print("Ray's GCS is gone (stopped by the same signal?): nothing left to drain; "
                  "stopping what remains of the local cluster", file=sys.stderr, flush=True)
            ray.shutdown()
