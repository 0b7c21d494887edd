"""The ingress's client-error handling, without Ray: bad bodies get OpenAI 400s, never 500s.

Hardens a FastAPI app exactly as each server replica hardens vLLM's OpenAI app
(``deployments.http.front.harden``: edge, handlers) and mounts stand-in routes with vLLM's
own body models (those of the real endpoints), so each case runs in milliseconds.
``test_serve_fuzz.py`` checks the same properties end to end against the served stack.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest

from deployments.config import HTTPEdge
from deployments.http.edge import Edge
from deployments.http.front import harden


@pytest.fixture(autouse=True)
def open_edge() -> None:
    """The edge as on a loopback bind without keys (what `make run` starts with)."""


@pytest.fixture(scope="module")
def client() -> TestClient:
    app: FastAPI = harden(FastAPI(), Edge.start(HTTPEdge(), "127.0.0.1", environ={}))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
        return {"messages": len(body.messages)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> dict[str, Any]:
        return {"prompt": body.prompt}

    return TestClient(app, raise_server_exceptions=False)


def error_of(resp: Any) -> dict[str, Any]:
    assert resp.status_code == 400, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["message"].startswith("Invalid request: ")
    return error


@pytest.mark.parametrize("messages", [None, 5, 1.5, True, "not a list", {"role": "user"}])
def test_chat_messages_not_a_list_is_a_400_naming_the_field(client: TestClient,
                                                            messages: Any) -> None:
    error = error_of(client.post("/v1/chat/completions",
                                 json={"model": "m", "messages": messages}))
    assert error["param"] == "messages"
    assert f"({type(messages).__name__}): expected a list of message objects" in error["message"]
    assert "Fix:" in error["message"]


def test_valid_chat_still_parses(client: TestClient) -> None:
    resp = client.post("/v1/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
    assert resp.status_code == 200 and resp.json() == {"messages": 1}


@pytest.mark.parametrize(("raw", "ctype", "says"), [
    (b"hello", "text/plain", "Content-Type: application/json (got Content-Type: text/plain)"),
    (b"\xff\xfe\x00", "application/x-www-form", "<3 bytes of non-JSON body>"),
    (b'{"model": "x", "prompt": ', "application/json", "the body is not valid JSON"),
    (b"NaN", "application/json", "(got nan)"),
    (b"", "application/json", "the body is empty"),
])
def test_non_json_bodies_are_400_not_500(client: TestClient, raw: bytes, ctype: str,
                                         says: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        error = error_of(client.post(path, content=raw, headers={"Content-Type": ctype}))
        assert says in error["message"], error


def test_field_errors_name_the_field_and_never_echo_unserializable_input(
        client: TestClient) -> None:
    body = b'{"model": "m", "prompt": "x", "temperature": NaN, "stop": 5}'
    error = error_of(client.post("/v1/completions", content=body,
                                 headers={"Content-Type": "application/json"}))
    assert error["param"] == "stop"
    assert "stop: Input should be a valid string (got 5)" in error["message"]


def test_long_input_is_truncated_in_the_message(client: TestClient) -> None:
    error = error_of(client.post("/v1/completions",
                                 json={"model": "m", "prompt": "x", "n": "9" * 500 + "x"}))
    assert error["param"] == "n" and len(error["message"]) < 400
