"""Serve's proxy answers its own ``/-/`` routes only with a key; ``/-/healthz`` stays open.

The gate is what Ray 2.60's proxy gets from ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``:
validated and applied here by Ray's own code (``validate_http_proxy_callback_return``,
``_apply_middlewares``) around a real Starlette app with the proxy's route shapes.
"""

from __future__ import annotations

import os

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from deployments import ray_touches
from deployments.http import proxy_gate

KEY = "k" * 40


def _proxy(env: dict[str, str]) -> TestClient:
    from ray.serve._private.http_util import (
        _apply_middlewares,
        call_function_from_import_path,
        validate_http_proxy_callback_return,
    )

    async def ok(request: Request) -> PlainTextResponse:
        return PlainTextResponse("success")

    app = Starlette(routes=[Route(p, ok) for p in ("/-/routes", "/-/healthz", "/v1/models")])
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:  # the callback reads the proxy's environment, as in the proxy actor
        middlewares = validate_http_proxy_callback_return(
            call_function_from_import_path(proxy_gate.CALLBACK))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return TestClient(_apply_middlewares(app, middlewares))


def test_the_touch_holds_in_the_pinned_ray() -> None:
    assert ray_touches.present("serve.proxy_callback")


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", ""])
def test_routes_need_a_key_and_healthz_stays_open(host: str) -> None:
    client = _proxy({"DSV4_API_KEYS": KEY, proxy_gate.HOST_ENV: host})
    assert client.get("/-/routes").status_code == 401
    assert client.get("/-/routes", headers={"Authorization": "Bearer wrong" + KEY}
                      ).status_code == 401
    assert client.get("/-/routes", headers={"Authorization": f"Bearer {KEY}"}
                      ).status_code == 200
    assert client.get("/-/healthz").status_code == 200  # KubeRay's readiness probe
    # application routes are the replicas' edge's to judge, with the app's settings
    assert client.get("/v1/models").status_code == 200


def test_a_root_path_or_a_websocket_does_not_get_past_the_gate() -> None:
    from starlette.websockets import WebSocketDisconnect

    client = _proxy({"DSV4_API_KEYS": KEY, proxy_gate.HOST_ENV: "127.0.0.1"})
    scope = {"type": "http", "path": "/api/-/routes", "root_path": "/api"}
    assert proxy_gate.route(scope) == "/-/routes" and proxy_gate.gated(scope)
    assert not proxy_gate.gated(scope | {"path": "/api/-/healthz"})
    with pytest.raises(WebSocketDisconnect) as closed, client.websocket_connect("/-/routes"):
        pass
    assert closed.value.code == 1008


def test_beyond_loopback_without_keys_nobody_lists_the_routes() -> None:
    assert _proxy({proxy_gate.HOST_ENV: "0.0.0.0"}).get("/-/routes").status_code == 401
    assert _proxy({}).get("/-/routes").status_code == 401  # host unknown: fail closed


def test_loopback_without_any_key_stays_open_like_the_edge() -> None:
    assert _proxy({proxy_gate.HOST_ENV: "127.0.0.1"}).get("/-/routes").status_code == 200


def test_the_local_start_sets_the_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    from deployments.local import ray_head

    monkeypatch.delenv(proxy_gate.CALLBACK_ENV, raising=False)
    ray_head.proxy_gate_env("127.0.0.1")
    assert os.environ[proxy_gate.CALLBACK_ENV] == proxy_gate.CALLBACK
    assert os.environ[proxy_gate.HOST_ENV] == "127.0.0.1"
    monkeypatch.setenv(proxy_gate.CALLBACK_ENV, "mine.callback")
    [line] = ray_head.proxy_gate_env("127.0.0.1")
    assert "mine.callback kept" in line and os.environ[proxy_gate.CALLBACK_ENV] == "mine.callback"
