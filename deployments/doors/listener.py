"""A replica's own HTTP door: the hardened app on ``host:port``, on the app's event loop.

Two doors use it: ``http.replica_port``, one port all the app's replicas on a machine
share (below), and the replica's own port behind HAProxy
(``deployments.doors.haproxy_target``: one port per replica, ``shared=False``).

Why (issue 25, docs/benchmarks.md §2g): through Serve's HTTP proxy every request and
every streamed chunk crosses a second Python process (the proxy) as its own Ray object:
~7 ms per request and ~6 CPU-ms per token on 2 cores, where vLLM's own API server
spends 1.2. Ray 2.60's ways around the proxy do not fit a local run: direct ingress
gives each replica a private port nobody balances over, and its balancer, HAProxy,
binds all interfaces with an unauthenticated stats page and ignores our routing (the
KV-spec drain).

How: each ingress replica, once its engine is up, serves the same ASGI app Serve
uses (``front.harden``: keys, bounds, route table, stream limits, ``/v1/kv-spec``)
with uvicorn on its own event loop, on a socket bound with ``SO_REUSEPORT``. Every
replica of the app on this machine binds the same ``host:port``; the kernel hands each
new connection to one of them. So a request crosses no proxy: client -> replica.

* Why the port is closed is a set of reasons (``close_for``): ``drain`` (the KV-spec
  verdict; lifted by ``resume``), ``engine`` (the engine died: the kernel must stop
  sending this replica 1/N of new connections) and ``stop`` (Serve stops the replica).
  A closed replica's socket is closed at once (the kernel stops sending it
  connections); keep-alive clients are told to reconnect; held requests finish.
* Shutdown (``watch`` + ``stop``): the replica tells the listener how to see that Serve
  began stopping it; the port closes then, not at ``__del__``, and the held requests
  get what is left of the deployment's graceful shutdown time. At its end they are cut
  with an error event (``guard.HeldRequests``) before Serve's ``ray.kill``.
* Bounds before any key (``guard``, ``http.replica_port_limits``): a header
  deadline, an idle deadline, a connection cap.
* Who can connect: the socket binds ``http_options.host``, the address Serve's proxy
  binds, so the edge's loopback rule (keys beyond loopback) judges the same address.

uvicorn is used through its public ``Config``/``Server`` API, as vLLM's own server does;
no Ray internals are touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
from collections.abc import Callable
from typing import Any

from deployments.config.http import ReplicaPortLimits
from deployments.doors.guard import HeldRequests, limited_protocol
from deployments.logs import get_logger

logger = get_logger("listener")

# How long ``start`` waits for uvicorn to report it is accepting.
START_TIMEOUT_S = 30.0
# Kept from the shutdown budget to write the cut requests' error events before ray.kill.
CUT_MARGIN_S = 2.0


REPLICA_PORT_FIX = ("free the port (another program holds it without SO_REUSEPORT) or "
                    "pick another http.replica_port")


def reuse_port_socket(host: str, port: int, setting: str = "http.replica_port",
                      fix: str = REPLICA_PORT_FIX) -> socket.socket:
    """A TCP socket bound to ``host:port`` with SO_REUSEPORT (and SO_REUSEADDR).

    Raises ``OSError`` naming the address when another process holds the port without
    SO_REUSEPORT (or as another user): then the kernel will not share it.
    """
    family = socket.AF_INET6 if _is_ipv6(host) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind {host}:{port} for {setting}: "
                      f"{exc.strerror}. Fix: {fix}") from exc
    sock.set_inheritable(False)
    return sock


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False



def listeners_on(port: int) -> set[int]:
    """Socket inodes listening on TCP ``port`` in this network namespace (Linux).

    Replicas sharing ``port`` through SO_REUSEPORT are exactly the kernel's listeners
    in this namespace (this node, or pod): the ones a closing replica leaves the port to.
    """
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows, None)
                for row in rows:
                    fields = row.split()
                    if len(fields) > 9 and fields[3] == "0A" and \
                            int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(int(fields[9]))
        except FileNotFoundError:
            continue
    return inodes


class ReplicaListener:
    """The app on ``host:port`` (shared), in this replica's event loop; closable for reasons."""

    def __init__(self, app: Any, host: str, port: int,
                 limits: ReplicaPortLimits | None = None,
                 setting: str = "http.replica_port", shared: bool = True,
                 fix: str = REPLICA_PORT_FIX):
        self._held = HeldRequests(app)
        self._setting, self._fix = setting, fix  # what chose the port, and the fix (errors)
        self._shared = shared  # other replicas of the app bind it too (logged)
        self.host = host
        self.port = port
        self._limits = limits or ReplicaPortLimits()
        self._closed_for: set[str] = set()
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self._inode: int | None = None
        self._lock = asyncio.Lock()
        # Servers told to exit whose held connections may still be finishing.
        self._closing: list[tuple[Any, asyncio.Task[None]]] = []
        self._deadline: float | None = None  # loop time the held requests are cut at
        self._watcher: asyncio.Task[None] | None = None

    @property
    def listening(self) -> bool:
        return self._server is not None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def held(self) -> int:
        """Requests this replica holds on the port (open or closing servers)."""
        return self._held.count

    @property
    def closing(self) -> int:
        """Servers told to exit that still finish held connections."""
        self._prune()
        return len(self._closing)

    async def start(self) -> None:
        """Bind and accept, unless closed for a reason; returns once uvicorn accepts.

        Concurrent calls bind one server: the lock serialises them and the second finds
        the first's server (or the reason the port is closed).
        """
        async with self._lock:
            if self._server is not None or self._closed_for:
                return
            await self._serve()

    async def _serve(self) -> None:
        import uvicorn

        sock = reuse_port_socket(self.host, self.port, self._setting, self._fix)
        config = uvicorn.Config(
            self._held, lifespan="off",  # Serve runs the app's lifespan already
            access_log=False, log_config=None, log_level="warning",
            http=limited_protocol(self._limits),
            proxy_headers=False,  # X-Forwarded-For from a local client is not believed
            server_header=False, timeout_keep_alive=self._limits.idle_timeout_s)
        server = uvicorn.Server(config)
        # Never take the replica's signals (uvicorn would on the main thread).
        # (mypy: nullcontext is a class, not the method it replaces; install_signal_handlers
        # is absent from the uvicorn stubs mypy reads.)
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign, assignment]  # nullcontext is a class, not the method it replaces
        server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]  # absent from the uvicorn stubs mypy reads
        loop = asyncio.get_running_loop()
        task = loop.create_task(server.serve(sockets=[sock]))
        deadline = loop.time() + START_TIMEOUT_S
        while not server.started:
            if task.done():
                sock.close()
                raise RuntimeError(f"the replica's listener on {self.address} stopped "
                                   "while starting") from task.exception()
            if loop.time() > deadline:
                server.should_exit = True
                task.cancel()
                sock.close()
                raise RuntimeError(f"the replica's listener on {self.address} did not "
                                   f"start within {START_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.01)
        self._server, self._task = server, task
        self._inode = os.fstat(sock.fileno()).st_ino
        if self._closed_for:  # closed (drain, engine dead, stopping) while it started
            self.close_for(next(iter(self._closed_for)))
            return
        logger.info("dsv4: this replica answers HTTP itself on %s (%s; no proxy hop)",
                    self.address, "shared with the app's other replicas on this machine"
                    if self._shared else f"{self._setting}, its own")

    def close_for(self, why: str) -> None:
        """Stop taking connections (``why``: drain, engine, stop); held requests finish.

        The kernel sends new connections to the other replicas sharing the port; if
        none is left, clients are refused (Serve's proxy port still answers).
        """
        first = not self._closed_for
        self._closed_for.add(why)
        self._prune()
        if self._server is None:
            return
        assert self._task is not None
        for accepting in self._server.servers:  # at once, not at uvicorn's next tick
            accepting.close()
        self._server.should_exit = True
        self._closing.append((self._server, self._task))
        self._server = self._task = None
        if first:
            logger.warning("dsv4: stopped taking connections on %s (%s); held requests "
                           "finish", self.address, why)

    async def open_for(self, why: str) -> None:
        """Lift one reason; take connections again when none is left."""
        self._closed_for.discard(why)
        await self.start()

    def pause(self) -> None:
        """The KV-spec drain: closed until ``resume``."""
        self.close_for("drain")

    async def resume(self) -> None:
        """The drain was lifted."""
        await self.open_for("drain")

    def engine_dead(self) -> None:
        """The engine died: no new connection may land here until Serve replaces us."""
        if "engine" not in self._closed_for:
            logger.error("dsv4: the engine is dead; closing this replica's share of %s",
                         self.address)
        self.close_for("engine")

    def others_listening(self) -> bool:
        """Whether another socket in this namespace listens on the port (the kernel's
        group this replica shares it with); on a read failure, assume none."""
        try:
            return bool(listeners_on(self.port) - {self._inode})
        except OSError as exc:
            logger.warning("dsv4: cannot read the listeners on port %d (%s); keeping it "
                           "open", self.port, exc)
            return False

    def watch(self, stopping: Callable[[], bool], budget_s: float,
              poll_s: float = 0.25, hold_s: float = 0.0) -> None:
        """Poll ``stopping`` (Serve began stopping this replica); ``hold_s`` later (a
        balancer in front deregisters the replica meanwhile: it fails the health check
        while the port still answers) ``begin_stop`` with what Serve has left, at most."""
        async def poll() -> None:
            while not stopping():  # noqa: ASYNC110  # polls Serve's flag; no event to await
                await asyncio.sleep(poll_s)
            if hold_s > 0:
                logger.info("dsv4: Serve is stopping this replica; %s keeps answering "
                            "for %g s while the balancer takes it out", self.address, hold_s)
                await asyncio.sleep(hold_s)
            self.begin_stop(budget_s - poll_s - hold_s)

        self._watcher = asyncio.get_running_loop().create_task(poll())
        self._watcher.add_done_callback(_log_failure)

    def begin_stop(self, budget_s: float) -> None:
        """Close the port now; held requests are cut ``budget_s`` from now (less a margin
        for their error events). A later call never extends the first deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, budget_s - CUT_MARGIN_S)
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline
        self.close_for("stop")

    async def stop(self, budget_s: float) -> None:
        """``begin_stop``, then wait for held requests until the deadline; cut the rest."""
        self.begin_stop(budget_s)
        if self._watcher is not None:
            self._watcher.cancel()
        assert self._deadline is not None
        loop = asyncio.get_running_loop()
        tasks = [task for _, task in self._closing if not task.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, self._deadline - loop.time()))
            if pending:
                cut = self._held.cut(f"this replica is shutting down; its {budget_s:.0f} s "
                                     "drain budget ran out. Retry the request.")
                if cut:
                    logger.warning("dsv4: %d request(s) on %s still held at the end of the "
                                   "shutdown budget; ending them with an error", cut,
                                   self.address)
                _, pending = await asyncio.wait(pending, timeout=CUT_MARGIN_S)
            if pending:
                for server, _ in self._closing:
                    server.force_exit = True
                await asyncio.wait(pending, timeout=1.0)
        self._prune()

    def _prune(self) -> None:
        self._closing = [(s, t) for s, t in self._closing if not t.done()]


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("dsv4: the replica's shutdown watch failed; the port closes at "
                     "__del__ instead", exc_info=task.exception())
