"""Serve's proxy's own routes answer only with a key (``/-/healthz`` stays open for probes).

Serve's HTTP proxy answers ``GET /-/routes`` (every application and its route prefix)
itself, before any replica and so before the edge's key check. Ray 2.60 lets a
callback named by ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` wrap the proxy's whole
ASGI app in Starlette middlewares (``ray_touches``: ``serve.proxy_callback``);
``proxy_middlewares`` is that callback. It gates the proxy's ``/-/`` paths with the
edge's own check (``keycheck.AuthMiddleware`` over ``auth.KeyStore``, the same keys from
the same environment) and leaves ``/-/healthz`` keyless: KubeRay's readiness probe and
``serve status`` call it and it says only "success". Application routes pass untouched:
the edge in each replica checks them with the application's own auth settings.

The proxy's bind host comes from ``DSV4_PROXY_HOST`` (set by the local start from
``http_options.host``); unset, the proxy counts as reachable from other machines, so a
key is required whenever ``http.auth`` would require one there (fail closed).
"""

from __future__ import annotations

import os
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from deployments.config import AuthConfig
from deployments.http.auth import KeyStore
from deployments.http.edge import middleware
from deployments.http.keycheck import AuthMiddleware

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "deployments.http.proxy_gate.proxy_middlewares"
HOST_ENV = "DSV4_PROXY_HOST"
PROXY_PREFIX = "/-/"
OPEN_PATHS = frozenset({"/-/healthz"})


def proxy_gate_env(host: str | None = None) -> dict[str, str]:
    """The env that gates Serve's proxy routes: set before Ray starts (inherited)."""
    return {CALLBACK_ENV: CALLBACK} | ({HOST_ENV: host} if host else {})


def route(scope: Scope) -> str:
    """The path as Serve's proxy matches it: ``path`` past ``root_path`` (Ray 2.60
    ``ProxyRequest.route_path``), so a root path cannot hide ``/-/routes`` from the gate."""
    path, root = str(scope.get("path", "")), str(scope.get("root_path", ""))
    return path[len(root):]


def gated(scope: Scope) -> bool:
    """One of the proxy's own routes other than the probes' health check."""
    return (scope["type"] in ("http", "websocket") and route(scope).startswith(PROXY_PREFIX)
            and route(scope) not in OPEN_PATHS)


class ProxyRoutesGate:
    """ASGI middleware: the proxy's ``/-/`` routes through the edge's key check."""

    def __init__(self, app: ASGIApp, keys: KeyStore, bind_host: str | None):
        self.app = app
        self.checked = AuthMiddleware(app, keys, bind_host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not gated(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":  # no proxy route speaks WebSocket: refused
            await send({"type": "websocket.close", "code": 1008})
        else:
            await self.checked(scope, receive, send)


def proxy_middlewares(environ: dict[str, str] | None = None) -> list[Any]:
    """Serve's proxy callback: the gate, with this process's keys and the proxy's host
    (Starlette ``Middleware`` entries, built where the edge builds its own)."""
    env = dict(os.environ) if environ is None else environ
    keys = KeyStore(AuthConfig(), env)
    return middleware([(ProxyRoutesGate, {"keys": keys,
                                          "bind_host": env.get(HOST_ENV) or None})])
