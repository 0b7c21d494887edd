"""What reaches the app without a key (issue 26): only real CORS preflights; no WebSocket.

Before, with ``cors_allow_origins`` set, any ``OPTIONS`` skipped the key check, so
``OPTIONS /metrics`` on vLLM's real app answered the Prometheus page; WebSocket
scopes went past the edge untouched. vLLM's real OpenAI app (``test_front``) and a
stand-in with a WebSocket route, both hardened by ``front.harden``.
"""

from __future__ import annotations

import pytest
from fastapi import FastAPI, WebSocket
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from deployments.config import HTTPEdge
from deployments.http.edge import Edge
from deployments.http.front import harden
from tests.support.vllm_app import vllm_app

KEY = "k" * 24
ORIGIN = "https://chat.example"
CORS = HTTPEdge(cors_allow_origins=[ORIGIN])


def _keys_required() -> Edge:
    """CORS on, bound beyond loopback, one key."""
    return Edge.start(CORS, "0.0.0.0", environ={"DSV4_API_KEYS": KEY})


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(harden(vllm_app(), _keys_required()), raise_server_exceptions=False)


@pytest.mark.parametrize("headers", [{}, {"origin": ORIGIN},
                                     {"access-control-request-method": "GET"}])
def test_a_non_preflight_options_needs_a_key(client: TestClient,
                                             headers: dict[str, str]) -> None:
    resp = client.options("/metrics", headers=headers)
    assert resp.status_code == 401, resp.text
    assert "# HELP" not in resp.text and "# TYPE" not in resp.text


def test_with_a_key_options_is_judged_like_any_request(client: TestClient) -> None:
    resp = client.options("/metrics", headers={"authorization": f"Bearer {KEY}"})
    assert resp.status_code == 404 and "# HELP" not in resp.text
    resp = client.options("/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert resp.status_code == 405 and resp.headers["allow"] == "GET"


def test_a_real_preflight_is_answered_without_a_key(client: TestClient) -> None:
    resp = client.options("/v1/chat/completions", headers={
        "origin": ORIGIN, "access-control-request-method": "POST"})
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == ORIGIN
    resp = client.options("/metrics", headers={
        "origin": ORIGIN, "access-control-request-method": "GET"})
    assert "# HELP" not in resp.text, "a preflight is answered by CORS, never by a route"


def _websocket_app() -> TestClient:
    app = FastAPI()

    @app.websocket("/v1/models")
    async def socket(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text("unauthenticated")
        await websocket.close()

    return TestClient(harden(app, _keys_required()))


@pytest.mark.parametrize("headers", [{}, {"authorization": f"Bearer {KEY}"}])
def test_websockets_are_refused(headers: dict[str, str]) -> None:
    with pytest.raises(WebSocketDisconnect) as closed:
        with _websocket_app().websocket_connect("/v1/models", headers=headers) as ws:
            ws.receive_text()
    assert closed.value.code == 1008


def test_lifespan_still_reaches_the_app() -> None:
    started: list[bool] = []
    app = FastAPI(on_startup=[lambda: started.append(True)])
    with TestClient(harden(app, _keys_required())):
        pass
    assert started == [True]
