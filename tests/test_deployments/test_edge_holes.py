"""Ways around the edge found on 9ac8359 (issue 32), each closed: every case failed there.

Stand-in apps hardened by ``front.harden`` (the whole edge stack), raw ASGI calls
(``tests.support.edge_app``). ``test_serve_security.py`` runs the same cases live.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, Literal

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from deployments.config import HTTPEdge
from deployments.http import routes
from deployments.http.edge import Edge
from deployments.http.front import harden
from tests.support.edge_app import Probe, build, call, error, guard, names, run

KEY = "k" * 24
SECRET = "pydantic_core ValidationError at /opt/vllm/secret.py pid=4242"


@pytest.fixture
def probe() -> Probe:
    return Probe()


# ------------------------------------------------------------------ fields at any depth


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions",
                                  "/v1/chat/completions/batch", "/v1/responses",
                                  "/v1/messages", "/v1/messages/count_tokens", "/tokenize"])
@pytest.mark.parametrize(("carrier", "where"), [
    ({"vllm_xargs": {"kv_transfer_params": 0}}, "vllm_xargs.kv_transfer_params"),
    ({"vllm_xargs": {"a": [{"b": {"ec_transfer_params": {}}}]}},
     "vllm_xargs.a.0.b.ec_transfer_params"),
    ({"extra_args": {"kv_transfer_params": False}}, "extra_args.kv_transfer_params"),
])
def test_transfer_params_nested_in_a_carrier_are_refused(
        probe: Probe, path: str, carrier: dict[str, Any], where: str) -> None:
    """vLLM copies ``vllm_xargs`` into ``SamplingParams.extra_args``, where NIXL reads
    ``kv_transfer_params``: a falsy int there killed the P/D decode engine."""
    app = build(HTTPEdge(), probe)
    body = json.dumps({"prompt": "x", "messages": [], "input": "x", **carrier}).encode()
    status, _, data = run(call(app, "POST", path, body))
    err = error(data)
    assert status == 400 and names(err, where) and "remove" in err["message"], err
    assert probe.body_reads == 0


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/messages", {"messages": [], "max_tokens": 10, "min_tokens": "9000"}, "min_tokens"),
    ("/v1/messages", {"messages": [], "max_tokens": 10,
                      "thinking": {"type": "enabled", "budget_tokens": 1e6}},
     "thinking.budget_tokens"),
    ("/v1/responses", {"input": "x", "thinking_token_budget": 9000}, "thinking_token_budget"),
    ("/v1/chat/completions", {"messages": [], "thinking_token_budget": "9000"},
     "thinking_token_budget"),
    ("/v1/completions", {"prompt": "x", "thinking_token_budget": 9000.0},
     "thinking_token_budget"),
    ("/v1/chat/completions", {"messages": [], "repetition_detection": {
        "max_pattern_size": 10**6, "min_count": 2}}, "repetition_detection.max_pattern_size"),
    ("/v1/chat/completions/batch", {"messages": [[]], "best_of": "9"}, "best_of"),
])
def test_new_costly_fields_are_bounded_where_vllm_reads_them(
        probe: Probe, path: str, body: dict[str, Any], param: str) -> None:
    app = build(HTTPEdge(), probe)
    status, _, data = run(call(app, "POST", path, json.dumps(body).encode()))
    err = error(data)
    assert status == 400 and names(err, param) and "limit http.max_" in err["message"], err


@pytest.mark.parametrize("path", ["/checkpoint/prepare", "/checkpoint/restore",
                                  "/checkpoint/status", "/v1/fault_tolerance/apply",
                                  "/v1/fault_tolerance/status"])
def test_vllm_034_operator_routes_are_closed_with_a_reason(probe: Probe, path: str) -> None:
    app = build(HTTPEdge(), probe)
    status, _, data = run(call(app, "POST", path, b"{}", read_forbidden=True))
    assert status == 404 and routes.CLOSED[path] in error(data)["message"]


# ------------------------------------------------------------------ Anthropic's protocol


def _messages_app(edge: Edge, events: list[bytes], stall: bool = False) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        await request.body()

        async def stream() -> AsyncIterator[bytes]:
            for event in events:
                yield event
            if stall:
                await asyncio.sleep(30)

        return StreamingResponse(stream(), media_type="text/event-stream")

    return harden(app, edge)


def test_messages_stream_errors_are_scrubbed_in_anthropic_form() -> None:
    """vLLM's Anthropic stream ends with ``event: error`` quoting the internal text."""
    internal = json.dumps({"type": "error", "error": {"type": "internal_error",
                                                      "message": SECRET}})
    client = json.dumps({"type": "error", "error": {"type": "invalid_request_error",
                                                    "message": "bad tool"}})
    events = [b'event: message_start\ndata: {"type": "message_start"}\n\n',
              f"event: error\ndata: {client}\n\n".encode(),
              f"event: error\ndata: {internal}\n\n".encode()]
    app = _messages_app(guard(HTTPEdge()), events)
    status, _, data = run(call(app, "POST", "/v1/messages", b"{}",
                               headers={"x-request-id": "req-a"}))
    text = data.decode()
    assert status == 200 and "4242" not in text and "/opt/" not in text, text
    assert "bad tool" in text  # a client's own error stays as written
    last = json.loads(text.rsplit("data: ", 1)[1])
    assert last["type"] == "error" and last["error"]["type"] == "api_error"
    assert "req-a" in last["error"]["message"]


def test_messages_refusals_and_stream_limits_speak_anthropic() -> None:
    edge = guard(HTTPEdge(stream_idle_s=0.2), "0.0.0.0", DSV4_API_KEYS=KEY)
    app = _messages_app(edge, [b'event: ping\ndata: {"type": "ping"}\n\n'], stall=True)
    status, _, data = run(call(app, "POST", "/v1/messages", b"{}"))
    body = json.loads(data)
    assert status == 401 and body["type"] == "error"
    assert body["error"]["type"] == "authentication_error"
    status, _, data = run(call(app, "POST", "/v1/messages", b"{}",
                               headers={"authorization": f"Bearer {KEY}"}))
    assert status == 200 and data.endswith(b"\n\n")
    event = data.decode().rsplit("event: error\ndata: ", 1)[1]
    assert json.loads(event)["error"]["type"] == "timeout_error"
    assert "http.stream_idle_s" in event


# ------------------------------------------------------------------ slots


def test_costly_gets_take_a_slot(probe: Probe) -> None:
    """``/v1/kv-spec`` (a controller call each) and ``GET /v1/responses/{id}`` (a held
    replay stream) are admitted like generations; ``/health`` and models are not."""
    settings = HTTPEdge(max_in_flight=1, responses_store=True)
    edge = guard(settings)
    release = asyncio.Event()

    async def kv_spec(refresh: bool) -> tuple[dict[str, Any], str]:
        await release.wait()
        return {"state": "agree"}, "cached"

    app = harden(FastAPI(), edge, kv_spec)

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str) -> Any:
        return {"id": rid}

    @app.get("/health")
    async def health() -> Any:
        return {}

    async def scenario() -> list[int]:
        held = asyncio.ensure_future(call(app, "GET", routes.KV_SPEC_ROUTE))
        while edge.in_flight < 1:
            await asyncio.sleep(0.01)
        again = await call(app, "GET", routes.KV_SPEC_ROUTE)
        stored = await call(app, "GET", "/v1/responses/resp_1?stream=true")
        health = await call(app, "GET", "/health")
        release.set()
        return [again[0], stored[0], health[0], (await held)[0]]

    assert run(scenario()) == [503, 503, 200, 200]
    assert edge.in_flight == 0


def _background_app(edge: Edge, runs: dict[str, asyncio.Task[None]],
                    seen: list[dict[str, Any]], run_s: float) -> FastAPI:
    """vLLM's shape: create answers ``queued`` at once and runs the generation in a
    task kept in ``openai_serving_responses.background_tasks`` under the response id."""
    app = FastAPI()
    app.state.openai_serving_responses = SimpleNamespace(background_tasks=runs)

    @app.post("/v1/responses")
    async def create(request: Request) -> Any:
        body = await request.json()
        seen.append(body)
        rid = body["request_id"]
        runs[rid] = asyncio.ensure_future(asyncio.sleep(run_s))
        runs[rid].add_done_callback(lambda _: runs.pop(rid, None))
        return {"id": rid, "status": "queued"}

    return harden(app, edge)


def test_a_background_run_holds_its_slot_until_it_ends() -> None:
    edge = guard(HTTPEdge(max_in_flight=1, responses_store=True))
    runs: dict[str, asyncio.Task[None]] = {}
    seen: list[dict[str, Any]] = []
    app = _background_app(edge, runs, seen, run_s=0.5)
    body = json.dumps({"input": "x", "background": True}).encode()

    async def scenario() -> list[Any]:
        first = await call(app, "POST", "/v1/responses", body)
        during = edge.in_flight
        second = await call(app, "POST", "/v1/responses", body, read_forbidden=True)
        while edge.in_flight:
            await asyncio.sleep(0.05)
        third = await call(app, "POST", "/v1/responses", body)
        return [first[0], json.loads(first[2])["id"], during, second[0], third[0]]

    first, rid, during, second, third = run(scenario())
    assert first == 200 and rid == seen[0]["request_id"] and rid.startswith("resp_")
    assert during == 1 and second == 503 and third == 200


def test_a_background_run_is_cancelled_at_stream_max_s() -> None:
    edge = guard(HTTPEdge(responses_store=True, stream_max_s=0.3))
    runs: dict[str, asyncio.Task[None]] = {}
    app = _background_app(edge, runs, [], run_s=3600)
    body = json.dumps({"input": "x", "background": True}).encode()

    async def scenario() -> tuple[int, bool]:
        status = (await call(app, "POST", "/v1/responses", body))[0]
        task = next(iter(runs.values()))
        await asyncio.wait({task}, timeout=5)
        await asyncio.sleep(0.05)
        return status, task.cancelled()

    assert run(scenario()) == (200, True)
    assert edge.in_flight == 0


# ------------------------------------------------------------------ the owner


def test_the_request_owner_is_the_keys_digest_never_the_key() -> None:
    owners: list[Any] = []

    def app_for(edge: Edge) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            owners.append(request.scope["state"].get("dsv4_key_digest"))
            return {}

        return harden(app, edge)

    keyed = app_for(guard(HTTPEdge(), "0.0.0.0", DSV4_API_KEYS=KEY))
    run(call(keyed, "POST", "/v1/completions", b"{}",
             headers={"authorization": f"Bearer {KEY}"}))
    run(call(app_for(guard(HTTPEdge())), "POST", "/v1/completions", b"{}"))
    assert owners == [hashlib.sha256(KEY.encode()).hexdigest(), None]


@pytest.mark.parametrize(("event", "status"), [
    ({"error": {"message": SECRET, "code": 500}}, 500),
    ({"error": {"message": "bad", "code": 400}}, None),
    ({"type": "error", "error": {"type": "internal_error", "message": SECRET}}, 500),
    ({"type": "error", "error": {"type": "overloaded_error", "message": SECRET}}, 500),
    ({"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}, None),
    ({"type": "error", "code": "server_error", "message": SECRET, "sequence_number": 3}, 500),
    ({"type": "error", "code": 400, "message": "bad"}, None),
    ({"type": "response.output_text.delta", "delta": "error"}, None),
])
def test_server_errors_are_known_in_every_stream_format(event: dict[str, Any],
                                                        status: int | None) -> None:
    from deployments.http.scrub import scrubbed_event, server_error_status

    assert server_error_status(event) == status
    if status is not None:
        protocol: Literal["openai", "anthropic"] = "anthropic" if isinstance(
            event.get("error"), dict) and \
            event.get("type") == "error" else "openai"
        clean = json.dumps(scrubbed_event(event, status, "req-s", protocol))
        assert "4242" not in clean and "req-s" in clean
