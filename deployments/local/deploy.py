"""Deploy a Serve config's DSv4 applications onto a running Ray cluster; their URLs."""

from __future__ import annotations

import importlib
import socket
import threading
import time
from collections.abc import Callable

from deployments import serve_env
from deployments.config import ConfigError, ServeConfig


def base_url(config: ServeConfig, route_prefix: str | None = "/") -> str:
    """The OpenAI base URL of an application (clients append /chat/completions etc.):
    its replicas' own port when they have one (``http.replica_port``), else the proxy's."""
    http = config.http_options
    prefix = (route_prefix or "/").rstrip("/")
    own = {app.route_prefix or "/": port for app, port in config.replica_ports()}
    port = own.get(route_prefix or "/", http.port)
    return f"http://{http.host}:{port}{prefix}/v1"


def refuse_busy_ports(config: ServeConfig, timeout_s: float = 0.5) -> None:
    """Refuse to start when something already answers on a port the run will listen on.

    Serve's proxy and the replicas' own listeners (``http.replica_port``) bind with
    SO_REUSEPORT, so a second run (or any process of this user that does the same)
    would not fail to bind: it would silently share the port, and the kernel would
    hand the old program half of the new run's connections.
    """
    host = config.http_options.host
    probe = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # noqa: S104  # compares a bind address
    ports = [("http_options.port", config.http_options.port)]
    ports += [(f"{app.where}.http.replica_port", port) for app, port in config.replica_ports()]
    if config.ingress() == "haproxy":
        ports += serve_env.haproxy_side_ports()
    for field, port in ports:
        try:
            with socket.create_connection((probe, port), timeout=timeout_s):
                pass
        except OSError:
            continue
        raise ConfigError(f"{field}={port}: something already answers on {probe}:{port} "
                          "(another dsv4-serve run or Serve?). Fix: stop it, or pick "
                          "another port.")


APP_MODULE = "deployments.app"


def preload_app_module() -> threading.Thread:
    """Import the app builder's module in a background thread, so it overlaps starting
    Ray and Serve, which mostly waits on the processes it spawns. A one-pool app's
    builder imports no vLLM (``deployments.serving.server_options``: ~1 s); a P/D app's
    imports Ray Serve LLM's builders when it builds.

    Nothing is lost on failure: ``deploy`` imports the module itself, waiting on the
    import lock if this thread is still at it, and a failed import raises there again.
    ``ray.serve`` is imported first, here: starting Serve imports from it too, and a
    package both threads import piecemeal is where import locks could cross. So this
    imports Ray: call it after anything that must set Ray's environment first
    (``dsv4-serve run --nodes`` starts its cluster, with token auth, before).
    """
    importlib.import_module("ray.serve")
    thread = threading.Thread(target=importlib.import_module, args=(APP_MODULE,),
                              name="dsv4-preload-app", daemon=True)
    thread.start()
    return thread


def deploy(config: ServeConfig,
           on_running: Callable[[str], object] | None = None) -> dict[str, float]:
    """Deploy every application of ours; return seconds until each was RUNNING.

    ``on_running(name)`` is called as each application becomes RUNNING.
    """
    from ray import serve

    from deployments.app import build_parsed_app

    try:
        config.check_replica_ports()  # also for configs built in code, not by the loader
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    others = [a.name for a in config.applications if not a.is_ours]
    if others:
        raise ConfigError(
            f"applications {others} use another import_path; `dsv4-serve run` deploys only "
            "deployments.app:build_app. Fix: deploy the file with `serve deploy`."
        )
    seconds = {}
    for app, parsed in config.ours():  # parsed once by the loader, kept
        started = time.monotonic()
        serve.run(build_parsed_app(parsed), name=app.name, route_prefix=app.route_prefix)
        seconds[app.name] = round(time.monotonic() - started, 1)
        if on_running is not None:
            on_running(app.name)
    return seconds
