"""``dsv4-serve run [CONFIG]``: the whole stack on this machine, until Ctrl-C.

Validates the config (before anything starts), builds the tiny model if the
config serves it, starts a private local Ray cluster (``deployments.local.ray_head``),
deploys the Serve application(s) (``deployments.local.deploy``), waits until the KV-spec
controller has a verdict, sends one request to prove a token comes out
(``deployments.local.client``), prints the OpenAI base URL and the consensus
(``deployments.control.report``), and on Ctrl-C/SIGTERM drains and shuts down
(``deployments.local.drain``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from deployments import serve_env
from deployments.config import DEFAULT_CONFIG, ConfigError, ServeConfig, load_serve_config
from deployments.control.report import describe
from deployments.control.wire import FleetReport
from deployments.local.client import first_token, wait_for_verdict
from deployments.local.deploy import base_url, deploy, preload_app_module, refuse_busy_ports
from deployments.local.drain import StopSignal, exit_now, stop_everything
from deployments.local.ray_head import metrics_url, start_cluster
from deployments.logs import get_logger, plain_output

if TYPE_CHECKING:
    from deployments.local.cluster import LocalCluster

logger = get_logger("run")


@dataclass
class Timings:
    """Seconds since ``dsv4-serve run`` started, per milestone (printed and tested)."""

    start: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str) -> float:
        self.marks[name] = round(time.monotonic() - self.start, 1)
        return self.marks[name]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", type=Path, default=None,
                        help=f"Serve config YAML (default: {DEFAULT_CONFIG})")
    parser.add_argument("--config", dest="config_option", type=Path, default=None,
                        help="the same, as an option")
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


def config_path(args: argparse.Namespace) -> Path:
    """The config named positionally or by ``--config`` (not both), else the default."""
    given = [p for p in (args.config, getattr(args, "config_option", None)) if p is not None]
    if len(given) > 1 and given[0] != given[1]:
        raise ConfigError(f"two configs given ({given[0]} and --config {given[1]}). Fix: "
                          "name one.")
    return given[0] if given else DEFAULT_CONFIG


def main(args: argparse.Namespace) -> int:
    """Deploy, report, serve until a signal, shut down."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    plain_output()
    timings = Timings()
    try:
        config = load_serve_config(config_path(args))
        for line in serve_env.apply_ingress(config.ingress()):  # before Ray starts
            logger.info(line)
        from deployments.http.auth import preflight

        preflight(config)  # refuses a reachable bind without an API key, before Ray starts
        refuse_busy_ports(config)  # a private cluster: every port it listens on is ours
    except (ConfigError, ValueError) as exc:
        print(f"dsv4-serve run: {exc}", file=sys.stderr)
        return 2
    stop = StopSignal().install()
    nodes: LocalCluster | None = None
    try:
        if args.nodes is not None:
            # Before anything imports Ray: the driver takes the cluster's token auth
            # settings from its environment at import (cluster.LocalCluster.start).
            nodes = start_nodes(config, args)
            timings.mark("head up")
        preload_app_module()  # overlaps the ~7 s import of the app builder with Ray's start
        local_serve = start_cluster(config, args.num_cpus, args.metrics_port,
                                    address=nodes.address if nodes else None,
                                    on_ray_up=lambda: timings.mark("ray up"),
                                    wait_for_proxies=False)  # awaited after the deploy
        # ray.init replaces the SIGTERM handler with one that kills Ray's processes and
        # exits 1, skipping Serve's drain (replicas never stop their vLLM engines). Ours
        # again: SIGTERM then takes the same clean path as Ctrl-C.
        stop.install()
        timings.mark("ray+serve controller up")
        deploy(config, lambda name: timings.mark(f"app {name} RUNNING"))
        local_serve.proxies_ready()
        for app, parsed in config.ours():
            url = base_url(config, app.route_prefix)
            report = wait_for_verdict(url)
            print(f"[{app.name}] OpenAI base URL: {url}  (after {timings.mark('verdict')} s)")
            print(describe(FleetReport.model_validate(report)))
            if not args.no_smoke:
                latency = first_token(url, parsed.llm.model_loading_config.model_id)
                print(f"[{app.name}] first token after {timings.mark('first token')} s "
                      f"(request latency {latency} s)")
        print(f"Prometheus metrics: {metrics_url()}")
        stop.serving = True
        print("Serving; Ctrl-C to stop.", flush=True)
        while not stop.event.wait(1.0):
            pass
        code = 0
    except ConfigError as exc:
        print(f"dsv4-serve run: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("dsv4-serve run: interrupted while starting", file=sys.stderr)
        code = 130
    except (RuntimeError, TimeoutError) as exc:
        # Serve's "Deploying application ... failed" carries the replica's own error
        # (e.g. KVLayoutMismatch with its fix); print it without a Python traceback.
        print(f"dsv4-serve run: {exc}", file=sys.stderr)
        code = 1
    finally:
        try:
            stop_everything(stop, config)
        finally:
            if nodes is not None:
                nodes.stop()
        print(f"stopped after {timings.mark('stopped')} s", file=sys.stderr)
    if stop.ray_abandoned:  # the GCS died first: skip Ray's atexit shutdown (drain.exit_now)
        exit_now(code)
    return code


def start_nodes(config: ServeConfig, args: argparse.Namespace) -> LocalCluster:
    """``--nodes N``: place one replica per worker node and start the cluster's head.

    Worker nodes come later, from the autoscaler, as the replicas ask for them.
    """
    from deployments.local import cluster

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
    for app, _ in ours:
        app.parse()  # the bundles changed in place: keep the model in step
    spec = cluster.ClusterSpec(
        max_nodes=args.nodes,
        node_cpus=max(parsed.replica_cpus() for _, parsed in config.ours()),
        head_cpus=0,  # nothing of ours reserves CPU there (sizing.cluster_cpus)
        idle_timeout_s=args.node_idle_timeout_s,
    )
    return cluster.LocalCluster.start(spec)
