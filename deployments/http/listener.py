"""A replica's own HTTP door: the hardened app on ``host:port``, a port all replicas share.

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

* Drain (``pause``): a drained replica closes its socket (the kernel stops sending it
  connections), tells keep-alive clients to reconnect, and finishes what it holds.
* Shutdown (``stop``): the same, bounded by the deployment's graceful shutdown time;
  called before Serve shuts the app's lifespan down (``serving.server.listening``).
* Who can connect: the socket binds ``http_options.host``, the address Serve's proxy
  binds, so the edge's loopback rule (keys beyond loopback) judges the same address.

uvicorn is used through its public ``Config``/``Server`` API, as vLLM's own server does;
no Ray internals are touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from typing import Any

from deployments.logs import get_logger

logger = get_logger("listener")

# How long ``start`` waits for uvicorn to report it is accepting.
START_TIMEOUT_S = 30.0


def reuse_port_socket(host: str, port: int) -> socket.socket:
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
        raise OSError(exc.errno, f"cannot bind {host}:{port} for http.replica_port: "
                      f"{exc.strerror}. Fix: free the port (another program holds it "
                      "without SO_REUSEPORT) or pick another http.replica_port") from exc
    sock.set_inheritable(False)
    return sock


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


class ReplicaListener:
    """The app on ``host:port`` (shared), in this replica's event loop; pausable."""

    def __init__(self, app: Any, host: str, port: int, keep_alive_s: float = 90.0):
        self._app = app
        self.host = host
        self.port = port
        self._keep_alive_s = keep_alive_s
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        # Servers told to exit whose held connections may still be finishing.
        self._closing: list[tuple[Any, asyncio.Task[None]]] = []

    @property
    def listening(self) -> bool:
        return self._server is not None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Bind and accept; returns once uvicorn accepts (or raises why it cannot)."""
        if self._server is not None:
            return
        import uvicorn

        sock = reuse_port_socket(self.host, self.port)
        config = uvicorn.Config(
            self._app, lifespan="off",  # Serve runs the app's lifespan already
            access_log=False, log_config=None, log_level="warning",
            proxy_headers=False,  # X-Forwarded-For from a local client is not believed
            server_header=False, timeout_keep_alive=int(self._keep_alive_s))
        server = uvicorn.Server(config)
        # Never take the replica's signals (uvicorn would on the main thread).
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not server.started:
            if task.done():
                sock.close()
                raise RuntimeError(f"the replica's listener on {self.address} stopped "
                                   "while starting") from task.exception()
            if asyncio.get_running_loop().time() > deadline:
                server.should_exit = True
                raise RuntimeError(f"the replica's listener on {self.address} did not "
                                   f"start within {START_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.01)
        self._server, self._task = server, task
        logger.info("dsv4: this replica answers HTTP itself on %s (shared with the app's "
                    "other replicas on this machine; no proxy hop)", self.address)

    def pause(self) -> None:
        """Stop taking connections; finish held requests, close idle keep-alives.

        The kernel sends new connections to the other replicas sharing the port; if
        none is left, clients are refused (Serve's proxy port still answers).
        """
        if self._server is None:
            return
        assert self._task is not None
        self._server.should_exit = True
        self._closing.append((self._server, self._task))
        self._server = self._task = None
        logger.warning("dsv4: stopped taking connections on %s (drained); held requests "
                       "finish", self.address)

    async def resume(self) -> None:
        """Take connections again (the drain was lifted)."""
        await self.start()

    async def stop(self, timeout_s: float) -> None:
        """Pause, then wait up to ``timeout_s`` for held requests; cut what remains."""
        self.pause()
        closing, self._closing = self._closing, []
        tasks = [task for _, task in closing if not task.done()]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        if pending:
            logger.warning("dsv4: %d connection(s) on %s still open after %.0f s; closing",
                           len(pending), self.address, timeout_s)
            for server, _ in closing:
                server.force_exit = True
            await asyncio.wait(pending, timeout=5.0)
