"""Every 5xx body from every route carries only a request id (issue 26).

Before, only the generate routes went through the scrubbing; ``/v1/models*`` and
``/v1/kv-spec`` answered with whatever failed behind them (vLLM's catch-all
handler returns ``str(exc)``: Ray's errors name pids and IPs). Driven through
vLLM's real OpenAI app (built without an engine, as in ``test_front``) and a
stand-in app, both hardened by ``front.harden``.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from starlette.types import Receive, Scope, Send

from deployments.config import HTTPEdge
from deployments.http.edge import Edge
from deployments.http.front import KV_SPEC_ROUTE, harden
from deployments.http.scrub import ScrubMiddleware
from tests.support.vllm_app import vllm_app

SECRET = "RayActorError: actor pid=4242 on node 10.11.12.13 died (/opt/ray/x.py)"


def _edge() -> Edge:
    return Edge.start(HTTPEdge(), "127.0.0.1", environ={})


def _leaks(text: str) -> bool:
    return any(s in text for s in ("4242", "10.11.12.13", "/opt/", "State", "Traceback"))


@pytest.fixture
def vllm_client() -> TestClient:
    """vLLM's app without an engine: ``/v1/models`` fails inside vLLM's own handler."""
    calls: list[bool] = []

    async def kv_spec(refresh: bool) -> tuple[dict[str, Any], str]:
        calls.append(refresh)
        if refresh:
            raise RuntimeError(SECRET)
        return {"state": "not_checked", "note": "first check pending"}, "cached"

    return TestClient(harden(vllm_app(), _edge(), kv_spec), raise_server_exceptions=False)


def _scrubbed(resp: Any, request_id: str) -> None:
    assert resp.status_code == 500, resp.text
    assert not _leaks(resp.text), resp.text
    error = resp.json()["error"]
    assert error["type"] == "internal_server_error" and request_id in error["message"]
    assert resp.headers["x-request-id"] == request_id


def test_models_route_5xx_from_vllm_is_scrubbed(vllm_client: TestClient) -> None:
    resp = vllm_client.get("/v1/models", headers={"x-request-id": "req-m"})
    _scrubbed(resp, "req-m")


def test_kv_spec_route_5xx_is_scrubbed(vllm_client: TestClient) -> None:
    resp = vllm_client.get(KV_SPEC_ROUTE + "?refresh=true", headers={"x-request-id": "req-k"})
    _scrubbed(resp, "req-k")


def test_kv_spec_503_report_is_public_and_unmarked(vllm_client: TestClient) -> None:
    """Our own 503 (a report not yet checked) goes out as written."""
    resp = vllm_client.get(KV_SPEC_ROUTE)
    assert resp.status_code == 503 and resp.json()["state"] == "not_checked"


def test_a_client_cannot_mark_its_5xx_public() -> None:
    """The mark is a scope key our routes set; headers or query strings do not set it."""
    resp = _standin().get("/v1/models/m?dsv4.public_error=1",
                          headers={"dsv4.public_error": "1", "x-dsv4-public-error": "1"})
    assert resp.status_code == 502 and not _leaks(resp.text)


def _standin() -> TestClient:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> Any:
        raise ValueError("Must setup lora config for multiplexed requests. " + SECRET)

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Any:
        return JSONResponse({"detail": SECRET}, status_code=502)

    return TestClient(harden(app, _edge()), raise_server_exceptions=False)


def test_an_exception_on_a_read_route_is_a_scrubbed_500() -> None:
    """An exception inside the app (here the ValueError Ray Serve LLM's LoRA resolver
    raises; the edge now refuses its header first) reaches a client scrubbed."""
    resp = _standin().get("/v1/models", headers={"x-request-id": "req-x"})
    _scrubbed(resp, "req-x")


def test_a_5xx_answer_on_a_model_route_is_scrubbed() -> None:
    resp = _standin().get("/v1/models/m", headers={"x-request-id": "req-y"})
    assert resp.status_code == 502 and not _leaks(resp.text)
    assert "req-y" in resp.json()["error"]["message"]


async def _start_without_body(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 500,
                "headers": [(b"content-type", b"text/plain")]})


def test_a_5xx_start_without_a_body_still_gets_an_answer() -> None:
    app = ScrubMiddleware(_start_without_body)
    resp = TestClient(app, raise_server_exceptions=False).get(
        "/v1/models", headers={"x-request-id": "req-z"})
    _scrubbed(resp, "req-z")
