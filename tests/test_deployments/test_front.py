"""The server replica's HTTP front on vLLM's real OpenAI app, without an engine.

``deployments.http.front.harden`` is what every server replica applies to the app vLLM's
``build_app`` returns (``DSv4Server.__serve_build_asgi_app__``). vLLM's app is
built here from vLLM's own default front-end arguments (no engine: routes are never
reached), so what vLLM mounts and adds by default is checked against what we close:
its CORS middleware (``--allowed-origins`` defaults to ``*``), its extra routes
(``/metrics``, ``/tokenize``, ``/health``, docs), its validation handler. The live
path is ``tests/test_deployments/test_serve_security.py``.
"""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from starlette.middleware.cors import CORSMiddleware

from deployments.config import HTTPEdge
from deployments.doors.lifecycle import Doors
from deployments.http.edge import Edge, Layer, edge_stack
from deployments.http.errors import openai_validation_error
from deployments.http.front import KV_SPEC_ROUTE, PublicModelCards, harden
from deployments.http.scrub import ScrubMiddleware
from deployments.http.timing import TimingMiddleware
from tests.support.vllm_app import vllm_app


def _edge(settings: HTTPEdge | None = None) -> Edge:
    return Edge.start(settings or HTTPEdge(), "127.0.0.1", environ={})


@pytest.fixture(scope="module")
def client() -> TestClient:
    async def kv_spec(refresh: bool) -> tuple[dict[str, object], str]:
        return {"state": "disagree", "pid": 7, "note": "see /opt/x/y.py"}, "cached"

    return TestClient(harden(vllm_app(), _edge(), kv_spec), raise_server_exceptions=False)


def test_vllm_app_comes_with_its_own_cors_and_we_drop_it() -> None:
    app = vllm_app()
    assert [m for m in app.user_middleware if m.cls is CORSMiddleware], \
        "vLLM's build_app no longer adds CORS: recheck harden"
    hardened = harden(app, _edge())
    assert not [m for m in hardened.user_middleware if m.cls is CORSMiddleware]
    # outermost: the serving path's clock, then the edge
    assert [m.cls for m in hardened.user_middleware[:2]] == [TimingMiddleware, ScrubMiddleware]
    assert hardened.exception_handlers[RequestValidationError] is openai_validation_error


def test_configured_cors_is_ours() -> None:
    hardened = harden(vllm_app(), _edge(HTTPEdge(cors_allow_origins=["https://chat.example"])))
    [cors] = [m for m in hardened.user_middleware if m.cls is CORSMiddleware]
    assert cors.kwargs["allow_origins"] == ["https://chat.example"]


def test_harden_takes_its_layers_in_edge_stacks_order() -> None:
    """Every layer harden puts in front of vLLM's comes from ``edge_stack``, in its order:
    the edge, then the front's own (model cards, CORS), then vLLM's own middlewares."""
    settings = HTTPEdge(cors_allow_origins=["https://chat.example"])
    app = vllm_app()
    theirs = [m.cls for m in app.user_middleware if m.cls is not CORSMiddleware]
    edge = _edge(settings)
    hardened = harden(app, edge)
    inside: list[Layer] = [(PublicModelCards, {}), (CORSMiddleware, {})]
    expected = [cls for cls, _ in edge_stack(edge, None, inside)]
    assert [m.cls for m in hardened.user_middleware] == expected + theirs


@pytest.mark.parametrize("path", ["/metrics", "/load", "/docs", "/openapi.json", "/pooling",
                                  "/server_info", "/v1/systemone"])
def test_vllm_extra_routes_stay_closed(client: TestClient, path: str) -> None:
    resp = client.get(path)
    assert resp.status_code == 404, (path, resp.status_code, resp.text[:200])
    assert resp.json()["error"]["type"] == "not_found_error"
    assert "is closed on this server" in resp.json()["error"]["message"]


def test_vllm_surface_routes_reach_vllms_app(client: TestClient) -> None:
    """Served routes are vLLM's own handlers (this app has no engine behind it)."""
    assert client.get("/version").json() == {"version": "0.32.0"}
    assert client.get("/tokenize").status_code == 405  # POST only


def test_chat_messages_null_is_a_400_before_vllm_sees_it(client: TestClient) -> None:
    resp = client.post("/v1/chat/completions", json={"model": "m", "messages": None})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "messages"


def test_non_json_body_is_a_400_naming_the_content_type(client: TestClient) -> None:
    resp = client.post("/v1/completions", content=b"\xff\x00",
                       headers={"Content-Type": "text/plain"})
    assert resp.status_code == 400, resp.text
    assert "Content-Type: application/json" in resp.json()["error"]["message"]


def test_a_body_that_is_not_utf8_is_an_openai_400(client: TestClient) -> None:
    resp = client.post("/v1/completions", content=b"\x80",
                       headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and "Fix:" in error["message"]


def test_kv_spec_route_is_mounted_and_redacted(client: TestClient) -> None:
    resp = client.get(KV_SPEC_ROUTE)
    assert resp.status_code == 409 and resp.headers["x-dsv4-refresh"] == "cached"
    assert "pid" not in resp.json() and "/opt/" not in resp.text


class _AppOnlyEngine:
    """Stands in for the engine of a replica; builds vLLM's real OpenAI app, runs nothing."""

    async def build_asgi_app(self) -> FastAPI:
        return vllm_app()


def test_the_pd_decode_replica_serves_rays_prefill_first_routes_behind_our_edge() -> None:
    """The P/D decode replica's app (``DSv4PDDecodeServer.__serve_build_asgi_app__``
    through the real MRO): chat/completions are Ray's P/D routes (they call the
    replica's prefill-first ``chat``/``completions``), not vLLM's local ones; our edge
    is outermost, vLLM's CORS gone, ``/v1/kv-spec`` mounted. The live path:
    ``tests/test_deployments/test_pd_serving.py``."""
    import asyncio

    from fastapi.routing import APIRoute
    from ray.serve.llm import LLMConfig

    from deployments.pd.server import DSv4PDDecodeServer

    server = DSv4PDDecodeServer.sync_init(LLMConfig(model_loading_config={
        "model_id": "m"}))
    server.engine = _AppOnlyEngine()
    server._http = HTTPEdge()
    server._edge = _edge()  # what the replica's __init__ builds (``front.start_edge``)
    server._doors = Doors(server._http, answers_http=True, drain_timeout_s=1.0)
    assert not server._doors.own_port_behind_haproxy  # Serve's proxy is the door (default)

    async def kv_spec() -> None:
        raise AssertionError("not called")

    server._kv_spec, server._kv_spec_report = object(), kv_spec
    app = asyncio.run(server.__serve_build_asgi_app__())
    endpoints = {r.path: r.endpoint.__qualname__ for r in app.routes
                 if isinstance(r, APIRoute) and r.path in
                 ("/v1/completions", "/v1/chat/completions", KV_SPEC_ROUTE)}
    assert "PDOrchestratorMixin" in endpoints["/v1/completions"], endpoints
    assert "PDOrchestratorMixin" in endpoints["/v1/chat/completions"], endpoints
    assert KV_SPEC_ROUTE in endpoints
    assert [m.cls for m in app.user_middleware[:2]] == [TimingMiddleware, ScrubMiddleware]
    assert not [m for m in app.user_middleware if m.cls is CORSMiddleware]


def test_the_deployments_that_answer_http_are_the_servers_and_the_decode_pool() -> None:
    from deployments.serving.names import serves_http

    assert serves_http("DSv4Server:dsv4-tiny") and serves_http("DSv4DPServer:dsv4-tiny")
    assert serves_http("Decode:dsv4-tiny")
    assert not serves_http("Prefill:dsv4-tiny") and not serves_http("KVSpecController")
