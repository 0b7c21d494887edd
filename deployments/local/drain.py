"""Stopping ``dsv4-serve run`` cleanly: signals, draining in-flight requests, shutdown.

On Ctrl-C/SIGTERM the applications stop taking new requests, in-flight ones run to
their end (bounded by the replicas' ``graceful_shutdown_timeout_s``), the replicas
stop their vLLM engines, then Serve and Ray shut down. A process-group SIGTERM that
takes the GCS down with us is detected, so nothing waits on a dead cluster.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from deployments.config import ServeConfig
from deployments.control.wire import HTTP_IN_FLIGHT_STAT
from deployments.local.ray_head import gcs_reachable, shutdown
from deployments.logs import get_logger
from deployments.serving.names import ingress_drain_timeout_s, serves_http

logger = get_logger("run")


DRAIN_POLL_S = 0.5
# Serve's controller force-stops a replica at the end of its grace period; give it
# this long to do so before serve.shutdown() takes over.
DRAIN_MARGIN_S = 10.0


def drain_deadline_s(config: ServeConfig) -> float:
    """The longest our apps may take to drain: the ingress's grace period plus a margin."""

    longest = max((ingress_drain_timeout_s(args) for _, args in config.ours()), default=0.0)
    return longest + DRAIN_MARGIN_S


def in_flight_requests(app_names: list[str]) -> int:
    """Requests the apps' serving replicas are handling now (every client request
    passes exactly one: they are the ingress), read from the replica actors; 0 once
    they have stopped."""
    import ray

    from deployments.control.replicas import replica_actors

    handles = [ray.get_actor(actor["name"], namespace=actor["namespace"])
               for _, actor in replica_actors(app_names, serves_http)]
    counts = ray.get([h.get_num_ongoing_requests.remote() for h in handles], timeout=10)
    stats = ray.get([h.record_routing_stats.remote() for h in handles], timeout=10)
    # The edge's count also sees requests on the replicas' own port (http.replica_port),
    # which Serve never routes; Serve's also sees handle calls. The larger of the two.
    return int(sum(max(c, int((s or {}).get(HTTP_IN_FLIGHT_STAT, 0)))
                   for c, s in zip(counts, stats, strict=True)))


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
    their engines with them (``dsv4_patch.patches.lifetime``). A second signal
    (KeyboardInterrupt) ends the wait: ``stop_everything`` catches it and shuts down.
    """
    worker = threading.Thread(target=drain, args=(timeout_s,), name="dsv4-drain", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(GCS_POLL_S)
        if worker.is_alive() and not gcs_reachable():
            return False
    return True


@dataclass
class StopSignal:
    """Set by Ctrl-C/SIGTERM. While serving it ends the wait loop; while booting it
    aborts the boot (KeyboardInterrupt). Either way ``main`` drains and shuts Serve
    and Ray down; a second signal while draining stops waiting (KeyboardInterrupt)."""

    event: threading.Event = field(default_factory=threading.Event)
    serving: bool = False
    draining: bool = False
    # Set when the GCS died first: Ray's driver was left connected to nothing, and its
    # shutdown (ray.shutdown() or Ray's atexit hook) must not run (``exit_now``).
    ray_abandoned: bool = False

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
    except KeyboardInterrupt:  # a second signal, before or during the drain's wait
        print("second signal: not waiting for in-flight requests", file=sys.stderr,
              flush=True)
    finally:
        stop.draining = False
        if cluster_alive and gcs_reachable():
            shutdown()
        else:
            # ray.shutdown() would disconnect the driver's core worker from a GCS that is
            # gone: it retried for seconds and then died of SIGSEGV in CI, so run exited
            # -11. Ray's own daemons here are our children: stop them without it.
            print("Ray's GCS is gone (stopped by the same signal?): nothing left to drain; "
                  "stopping what remains of the local cluster", file=sys.stderr, flush=True)
            stop_children()
            stop.ray_abandoned = True


CHILD_GRACE_S = 5.0


def stop_children(grace_s: float = CHILD_GRACE_S) -> list[int]:
    """SIGTERM this process's children (the one-node cluster's Ray daemons ``ray.init``
    started, as ``ray.shutdown()`` would), SIGKILL what is left after ``grace_s``; the
    SIGKILLed pids. Their own children follow them: Ray's workers die with their raylet,
    vLLM's engines with their replica (``dsv4_patch.patches.lifetime``)."""
    import psutil

    children = psutil.Process().children()
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    killed = []
    for child in alive:
        try:
            name = child.name()
            child.kill()
        except psutil.NoSuchProcess:
            continue
        killed.append(f"{child.pid} {name}")
    if killed:
        print(f"SIGKILLed what outlived SIGTERM by {grace_s:g} s: {', '.join(killed)}",
              file=sys.stderr, flush=True)
    return sorted(c.pid for c in alive)


def exit_now(code: int) -> None:
    """End this process with ``code`` without Ray's atexit shutdown, which would run the
    same disconnect from a dead GCS that ``stop_everything`` skipped."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
