"""A local multi-node Ray cluster grown and shrunk by Ray's own autoscaler.

``dsv4-serve run --nodes N`` runs on it. The head takes no replicas (as KubeRay's
head does with ``num-cpus: 0``; here it offers CPU only for the OpenAI ingress);
up to N worker nodes -- each a separate raylet on this machine -- are added and
removed by Ray's real autoscaler (v2, the one KubeRay's in-tree autoscaling runs)
through Ray's fake multi-node node provider. Each worker node stands in for a GPU
node: it carries one ``dsv4_node`` resource and the CPUs of one replica, and every
replica's placement group asks for one ``dsv4_node`` -- the rule the GPU presets
express with ``{GPU: 8}`` per node. So: one replica per node, never on the head.

Two traps of Ray 2.60, avoided here (measured): the wheel lacks
``autoscaler/_private/fake_multi_node/example.yaml``, which provider type
``fake_multinode`` reads for its defaults (the monitor dies, no node is ever
added), so the provider is declared ``type: external`` with a subclass
(``deployments.local.node_provider``: one log monitor for the host, not one per node); and
``ray.cluster_utils.AutoscalingCluster.start()/shutdown()`` run ``ray stop
--force``, which kills every Ray cluster on the machine. This module starts its
own head (``ray start --head --block``) in a new session and stops exactly the
processes of that session -- head, autoscaler, every worker node, every replica
and engine -- and nothing else.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deployments import lifetime, serve_env
from deployments.local import ray_token
from deployments.local.session_procs import (
    FAKE_HEAD_NODE_ID,
    cmdline,
    session_pids,
    signal_all,
    worker_raylets,
)

logger = logging.getLogger("dsv4_serve.cluster")

NODE_RESOURCE = "dsv4_node"  # one per worker node: the stand-in for "a GPU node"
NODE_TYPE = "dsv4.node"
HEAD_TYPE = "ray.head.default"  # the fake provider's name for the head node type
# Ray's FakeMultiNodeProvider, its worker nodes without a log monitor of their own
# (RAY_FAKE_PROVIDER itself where the touch does not hold).
FAKE_PROVIDER = "deployments.local.node_provider.OneLogMonitorProvider"
RAY_FAKE_PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
OBJECT_STORE_BYTES = 200 * 1024 * 1024  # per node; the tiny model moves little data
STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class ClusterSpec:
    """The shape of the local cluster."""

    max_nodes: int
    node_cpus: float  # CPUs of one worker node = one replica (actor + bundles)
    head_cpus: float  # logical CPUs of the head; replicas never fit there (no NODE_RESOURCE)
    idle_timeout_s: float = 60.0
    object_store_bytes: int = OBJECT_STORE_BYTES

    def autoscaling_config(self, gcs_address: str,
                           provider: str = FAKE_PROVIDER) -> dict[str, Any]:
        """The autoscaler's cluster config (the YAML ``ray up`` takes), for one host."""
        store = {"object_store_memory": self.object_store_bytes}
        return {
            "cluster_name": "dsv4-local",
            "max_workers": self.max_nodes,
            "upscaling_speed": float(self.max_nodes),
            "idle_timeout_minutes": self.idle_timeout_s / 60.0,
            "provider": {
                "type": "external",
                "module": provider,
                "gcs_address": gcs_address,
                "head_node_id": FAKE_HEAD_NODE_ID,
                "launch_multiple": True,
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
            },
            "available_node_types": {
                HEAD_TYPE: {"resources": {"CPU": self.head_cpus}, "node_config": {},
                            "max_workers": 0},
                NODE_TYPE: {"resources": {"CPU": self.node_cpus, NODE_RESOURCE: 1} | store,
                            "node_config": {}, "min_workers": 0,
                            "max_workers": self.max_nodes},
            },
            "head_node_type": HEAD_TYPE,
            "auth": {},
            "docker": {},
            "file_mounts": {}, "cluster_synced_files": [],
            "file_mounts_sync_continuously": False,
            "rsync_exclude": [], "rsync_filter": [],
            "initialization_commands": [], "setup_commands": [],
            "head_setup_commands": [], "worker_setup_commands": [],
            "head_start_ray_commands": [], "worker_start_ray_commands": [],
        }


def auth_env(token_path: Path) -> dict[str, str]:
    """Ray token authentication with a token of this cluster's own (a 0600 file).

    Explicit, because Ray 2.60 decides by itself otherwise: ``ray start --head``
    turns token auth on whenever ``~/.ray/auth_token`` exists (any earlier local
    cluster on the machine writes it), while a driver given an explicit address
    never does -- and then cannot connect. Secure by default: token on, and the
    token is ours, not the machine-wide file (``ray_token``: checked, 0600). The driver
    and every process of the cluster (inherited environment) read the same file.
    """
    return ray_token.token_env(token_path, {})


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def node_ip() -> str:
    """The address Ray advertises for this machine (what the fake nodes use too)."""
    from ray.util import get_node_ip_address  # public since Ray 2.x (ray.util.__all__)

    return str(get_node_ip_address())


@dataclass
class LocalCluster:
    """A running head (and the worker nodes its autoscaler adds), in its own session."""

    spec: ClusterSpec
    address: str
    head: subprocess.Popen[bytes]
    log_path: Path
    config_path: Path
    started_s: float = field(default=0.0)

    @property
    def session(self) -> int:
        """The session id of every process of this cluster (the head's pid)."""
        return self.head.pid

    @classmethod
    def start(cls, spec: ClusterSpec, timeout_s: float = 120.0) -> LocalCluster:
        """Start the head with the autoscaler; return once its GCS accepts connections.

        The calling process becomes this cluster's driver: its environment gets the
        cluster's auth settings (``auth_env``). Call it before importing ``ray``: Ray
        reads them once, at import.
        """
        if "ray" in sys.modules:
            logger.warning("dsv4: ray was imported before LocalCluster.start: this process "
                           "may not pick up the cluster's token auth settings")
        started = time.monotonic()
        fd, config = tempfile.mkstemp(prefix="dsv4-autoscaler-", suffix=".json")
        os.environ.update(auth_env(Path(config).with_suffix(".token")))
        for line in serve_env.apply_local_quiet():  # every node's processes inherit it
            logger.info(line)
        port = free_port()
        address = f"{node_ip()}:{port}"
        with os.fdopen(fd, "w") as out:
            json.dump(spec.autoscaling_config(address, provider_module()), out)
        log_path = Path(config).with_suffix(".log")
        env = os.environ | {
            "RAY_FAKE_CLUSTER": "1",
            "RAY_enable_autoscaler_v2": "1",
            "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
            "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID,
        }  # the autoscaler's period stays Ray's (5 s), the one KubeRay's autoscaler runs
        cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
               f"--port={port}", f"--num-cpus={spec.head_cpus:g}",
               f"--object-store-memory={spec.object_store_bytes}",
               f"--autoscaling-config={config}", "--include-dashboard=false",
               "--disable-usage-stats", *head_log_monitor_flags()]
        with open(log_path, "wb") as log:
            head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,  # noqa: S603  # ray start, fixed arguments
                                    start_new_session=True, stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent(os.getpid()))
        cluster = cls(spec, address, head, log_path, Path(config))
        try:
            cluster._wait_for_gcs(port, started + timeout_s)
        except BaseException:
            cluster.stop()
            raise
        cluster.started_s = round(time.monotonic() - started, 1)
        logger.info("dsv4: local cluster head at %s (session %d, up to %d worker nodes of "
                    "%s CPU + 1 %s, idle nodes removed after %.0f s), in %.1f s", address,
                    cluster.session, spec.max_nodes, spec.node_cpus, NODE_RESOURCE,
                    spec.idle_timeout_s, cluster.started_s)
        return cluster

    def _wait_for_gcs(self, port: int, deadline: float) -> None:
        host = self.address.rpartition(":")[0]
        while time.monotonic() < deadline:
            if self.head.poll() is not None:
                raise RuntimeError(f"`ray start --head` exited with {self.head.returncode}; "
                                   f"its output: {self.log_path.read_text()[-2000:]}")
            try:
                with socket.create_connection((host, port), timeout=1):
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"the head's GCS at {self.address} did not answer in time; "
                           f"see {self.log_path}")

    def worker_raylets(self) -> dict[str, int]:
        """Ray node id -> raylet pid of every live worker node of this cluster."""
        return worker_raylets(self.session)

    def stop(self, grace_s: float = STOP_GRACE_S) -> list[int]:
        """SIGTERM every process of the session, SIGKILL what is left after ``grace_s``.

        Scoped by construction: only processes in this cluster's session (no
        ``ray stop``, which finds Ray processes machine-wide). Returns the pids that
        needed SIGKILL. Run ``serve.shutdown()``/``ray.shutdown()`` first so replicas
        stop their engines gracefully.
        """
        # The nodes' processes first; then `ray start --block` and Ray's reaper, which
        # wait for their children (and need a nudge once those are gone).
        keepers = {self.head.pid} | {p for p in session_pids(self.session)
                                     if b"ray_process_reaper" in cmdline(p)}
        signal_all([p for p in session_pids(self.session) if p not in keepers],
                    signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while set(session_pids(self.session)) - keepers and time.monotonic() < deadline:
            time.sleep(0.2)
        stubborn = [p for p in session_pids(self.session) if p not in keepers]
        signal_all(session_pids(self.session), signal.SIGTERM)
        deadline = time.monotonic() + 3
        while session_pids(self.session) and time.monotonic() < deadline:
            time.sleep(0.2)
        signal_all(session_pids(self.session), signal.SIGKILL)
        if self.head.poll() is None:
            self.head.wait(10)
        if stubborn:
            logger.warning("dsv4: %d process(es) of the local cluster needed SIGKILL: %s",
                           len(stubborn), {p: cmdline(p)[:60] for p in stubborn})
        self.config_path.unlink(missing_ok=True)
        self.config_path.with_suffix(".token").unlink(missing_ok=True)
        if not stubborn:  # kept otherwise: the head's output tells why
            self.log_path.unlink(missing_ok=True)
        return stubborn


def provider_module() -> str:
    """Our provider where its Ray touch holds; else Ray's own, said in a warning."""
    from deployments import ray_touches

    if ray_touches.present("ray.fake_nodes_one_log_monitor"):
        return FAKE_PROVIDER
    logger.warning("dsv4: this Ray lacks ray.fake_nodes_one_log_monitor (deployments/"
                   "ray_touches/): every local worker node starts a log monitor of its own "
                   "(more CPU at rest, duplicated forwarded logs)")
    return RAY_FAKE_PROVIDER


def head_log_monitor_flags() -> list[str]:
    """``ray start`` flags for the head's log monitor: off unless a driver reads it.

    The log monitor only forwards worker logs to drivers that ask (``log_to_driver``);
    ``dsv4-serve run`` asks only with ``DSV4_LOG_TO_DRIVER=1`` (as the one-node head,
    ``ray_head.quiet_head``). Off, it costs nothing at rest; the logs stay in the
    session directory either way. Worker nodes never start one (``node_provider``).
    """
    return [] if os.environ.get("DSV4_LOG_TO_DRIVER") == "1" else ["--include-log-monitor=false"]


def _die_with_parent(parent: int) -> Any:
    """A ``preexec_fn``: the head (``ray start --block``) is SIGKILLed when we die.

    A driver killed with SIGKILL (or by the OOM killer) runs no ``stop()``, and the
    head lives in its own session, so without this the whole cluster would outlive
    it. Once ``ray start --block`` is gone, Ray's own reaper (``ray_process_reaper``,
    whose stdin pipe it held) SIGTERMs the session's process group -- raylets,
    the autoscaler, the worker nodes it started, replicas -- and SIGKILLs it 1 s
    later; engine processes end with their replica (``dsv4_patch.patches.lifetime``).
    The signal follows the thread that started the head, so ``LocalCluster.start``
    must run on a thread that lives as long as the cluster (the CLI's main thread).
    """
    return lifetime.preexec_die_with_parent(parent)


def place_one_replica_per_node(apps_args: list[dict[str, Any]]) -> list[str]:
    """Ask for one ``NODE_RESOURCE`` in the first bundle of each app's replicas (in place).

    Returns what was changed, for the log: the user's bundles gain one resource
    and nothing else; bundles that already ask for it are left as they are.
    """
    changes = []
    for args in apps_args:
        pg = args["llm"].get("placement_group_config")
        if pg is None:
            raise ValueError("llm.placement_group_config is missing: --nodes places each "
                             "replica's bundles on one worker node. Fix: add "
                             "placement_group_config: {bundles: [{CPU: 1}]}.")
        if any(NODE_RESOURCE in b for b in pg["bundles"]):
            continue
        pg["bundles"][0] = pg["bundles"][0] | {NODE_RESOURCE: 1}
        changes.append(f"{args['llm']['model_loading_config']['model_id']}: bundles[0] "
                       f"+= {{{NODE_RESOURCE}: 1}} (one replica per worker node)")
    return changes
