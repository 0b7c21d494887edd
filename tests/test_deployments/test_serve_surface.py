"""What a `vllm serve` user calls, through our stack: the official clients, a real fleet.

Runs against ``conftest.serve_stack`` (``configs/local-cpu.yaml``: 2 replicas of the tiny
DeepSeek-V4 with DeepSeek-V4's tokenizer mode, tool-call and reasoning parsers, as the GPU
presets run it). The weights are random, so the tests assert the shape of what comes
back (a well-formed tool call, reasoning text, the event types), never its meaning.
Named/required tool choice is forced by a structural tag that starts after the
reasoning ends, so those calls turn thinking off (``chat_template_kwargs``).

The second half is the hostile-input suite on the same replicas: every bound of every
served route in the encodings vLLM's models coerce, fields only the server may set, a
1 MiB body of escaped quotes, trickled uploads; after each, the replicas still serve.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any, cast
from urllib.parse import urlsplit

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "dsv4-tiny"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def base(serve_stack: Any) -> str:
    """The app's root URL (the OpenAI base URL without ``/v1``)."""
    parts = urlsplit(serve_stack.url)
    return f"{parts.scheme}://{parts.netloc}"


@pytest.fixture(scope="module")
def oai(serve_stack: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=serve_stack.url, api_key="unused", max_retries=0,
                       timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def limits(serve_stack: Any) -> Any:
    [(_, args)] = serve_stack.config.ours()
    return args.http


def _assert_call(call: Any) -> None:
    assert call.type == "function" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)
    assert call.id


# ------------------------------------------------------------------ tools and reasoning


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_forced_tool_choice_gives_a_well_formed_call(oai: openai.OpenAI, choice: Any) -> None:
    resp = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice=choice, max_tokens=64,
                                       extra_body=NO_THINKING)
    [call] = resp.choices[0].message.tool_calls
    _assert_call(call)


def test_streamed_tool_call_deltas_assemble_into_one_call(oai: openai.OpenAI) -> None:
    deltas = [chunk.choices[0].delta.tool_calls[0]
              for chunk in oai.chat.completions.create(
                  model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=64,
                  stream=True, extra_body=NO_THINKING)
              if chunk.choices and chunk.choices[0].delta.tool_calls]
    assert deltas and deltas[0].id and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert isinstance(json.loads(arguments), dict)


def test_auto_tool_choice_is_accepted(oai: openai.OpenAI) -> None:
    resp = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice="auto", max_tokens=8)
    assert resp.choices[0].finish_reason in ("length", "stop", "tool_calls")


@pytest.mark.parametrize("effort", [None, "high"])
def test_thinking_on_returns_reasoning_apart_from_content(oai: openai.OpenAI,
                                                         effort: str | None) -> None:
    extra = {} if effort is None else {"reasoning_effort": effort}
    message = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                          **extra).choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning") or (
        message.model_extra or {}).get("reasoning_content")
    assert reasoning, message  # 8 tokens never leave the thinking block


# ------------------------------------------------------------------ the other APIs


def test_responses_create_and_stream(oai: openai.OpenAI) -> None:
    resp = oai.responses.create(model=MODEL, input="hi", max_output_tokens=8)
    assert resp.id.startswith("resp_") and resp.status in ("completed", "incomplete")
    kinds = [event.type for event in oai.responses.create(
        model=MODEL, input="hi", max_output_tokens=8, stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")


@pytest.mark.parametrize("extra", [{"store": True}, {"background": True},
                                   {"previous_response_id": "resp_0123"}])
def test_responses_that_need_the_store_name_the_setting(oai: openai.OpenAI,
                                                       extra: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="hi", max_output_tokens=4, **extra)
    assert "http.responses_store" in str(err.value)
    with pytest.raises(openai.NotFoundError) as missing:
        oai.responses.retrieve("resp_0123")
    assert "http.responses_store" in str(missing.value)


def test_anthropic_messages_and_count_tokens(base: str) -> None:
    with anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0,
                             timeout=120) as client:
        message = client.messages.create(model=MODEL, max_tokens=8,
                                         messages=[{"role": "user", "content": "hi"}])
        assert message.role == "assistant" and message.stop_reason == "max_tokens"
        counted = client.messages.count_tokens(model=MODEL,
                                               messages=[{"role": "user", "content": "hi"}])
        assert counted.input_tokens > 0


def test_tokenize_detokenize_version_health_and_batch(base: str) -> None:
    with httpx.Client(base_url=base, timeout=120) as http:
        tokens = http.post("/tokenize", json={"model": MODEL, "prompt": "hello"}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0
        text = http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]})
        assert "hello" in text.json()["prompt"]
        assert http.get("/version").json()["version"]
        health = http.get("/health")
        assert health.status_code == 200  # this replica's engine serves
        batch = http.post("/v1/chat/completions/batch",
                          json={"model": MODEL, "messages": [ASK, ASK], "max_tokens": 2})
        assert batch.status_code == 200 and len(batch.json()["choices"]) == 2
        closed = http.get("/metrics")
        assert closed.status_code == 404 and "ReplicaId" in closed.json()["error"]["message"]


# ------------------------------------------------------------------ hostile input


def _post(base: str, path: str, body: bytes | dict[str, Any],
          timeout: float = 60) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(base + path, content=raw, timeout=timeout,
                      headers={"content-type": "application/json"})


def _still_serves(base: str) -> None:
    resp = _post(base, "/v1/chat/completions",
                 {"model": MODEL, "messages": ASK, "max_tokens": 2})
    assert resp.status_code == 200, resp.text


BOUNDED = [  # (route, field, a value above the session's bound in some encoding)
    ("/v1/chat/completions", "n", "256"),
    ("/v1/chat/completions", "n", 256.0),
    ("/v1/chat/completions", "max_tokens", "900000"),
    ("/v1/chat/completions", "max_completion_tokens", 1e6),
    ("/v1/chat/completions", "min_tokens", 5000),
    ("/v1/chat/completions", "top_logprobs", "50"),
    ("/v1/chat/completions/batch", "max_tokens", 10**6),
    ("/v1/completions", "best_of", 64.0),
    ("/v1/completions", "logprobs", 1000),
    ("/v1/completions", "max_tokens", " 900000 "),
    ("/v1/responses", "max_output_tokens", "1e6"),  # not an int to pydantic: the schema's 400
    ("/v1/responses", "max_output_tokens", 10**6),
    ("/v1/messages", "max_tokens", "900000"),
]


def _body(path: str, **fields: Any) -> dict[str, Any]:
    """A valid small request for ``path``, with ``fields`` on top."""
    own = {"/v1/completions": {"prompt": "x", "max_tokens": 2},
           "/v1/responses": {"input": "x", "max_output_tokens": 2},
           "/v1/chat/completions/batch": {"messages": [ASK], "max_tokens": 2}}
    return {"model": MODEL, **own.get(path, {"messages": ASK, "max_tokens": 2}), **fields}


@pytest.mark.parametrize(("path", "field", "value"), BOUNDED)
def test_every_bound_holds_in_every_encoding(base: str, path: str, field: str,
                                             value: Any) -> None:
    resp = _post(base, path, _body(path, **{field: value}))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]  # /v1/messages: Anthropic's shape, no ``param``
    assert error.get("param") == field or field in error["message"], error


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions",
                                  "/v1/responses", "/v1/messages",
                                  "/v1/chat/completions/batch"])
def test_transfer_params_from_a_client_never_reach_an_engine(base: str, path: str) -> None:
    resp = _post(base, path, _body(path, kv_transfer_params={
        "remote_host": "10.0.0.9", "remote_port": 5600, "remote_block_ids": [1, 2, 3]}))
    error = resp.json()["error"]  # /v1/messages: Anthropic's shape, the field in the message
    assert resp.status_code == 400, resp.text
    assert error.get("param", "kv_transfer_params") == "kv_transfer_params"
    assert "kv_transfer_params" in error["message"]


def test_a_request_without_a_token_limit_stops_at_the_servers_bound(
        oai: openai.OpenAI, limits: Any) -> None:
    """No max_tokens on a chat, ignore_eos: vLLM would generate to max_model_len minus the
    prompt; the engine's default is http.max_tokens (override_generation_config). (The
    completions API has its own default of 16.)"""
    resp = oai.chat.completions.create(model=MODEL, messages=ASK,
                                       extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == limits.max_tokens


def test_a_mebibyte_of_escaped_quotes_is_answered_at_once(base: str) -> None:
    raw = b'{"model": "dsv4-tiny", "prompt": "' + b'\\"' * ((1 << 20) // 2 - 40)
    started = time.monotonic()
    resp = _post(base, "/v1/completions", raw)
    assert resp.status_code == 400 and time.monotonic() - started < 10, resp.text[:300]
    _still_serves(base)


def test_a_deep_utf16_body_is_a_400(base: str) -> None:
    deep = ('{"model": "dsv4-tiny", "prompt": "x", "e": ' + "[" * 3000 + "]" * 3000 + "}")
    resp = _post(base, "/v1/completions", deep.encode("utf-16"))
    assert resp.status_code == 400 and "UTF-8" in resp.json()["error"]["message"]


def test_trickled_uploads_hold_slots_until_their_408(base: str, limits: Any) -> None:
    """More connections than the fleet's in-flight bound, each declaring a body it never
    sends: an upload holds an in-flight slot while it arrives (issue 32), so the ones
    over a replica's share get a 503 at once, the rest a 408 at the body deadline, and
    the slots are free again afterwards."""
    host, port = urlsplit(base).hostname, urlsplit(base).port
    socks = []
    try:
        for _ in range(limits.max_in_flight + 8):
            sock = socket.create_connection((host, cast(int, port)),
                                            timeout=limits.body_timeout_s + 30)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                         b'{"model": ')
            socks.append(sock)
        answers = [sock.recv(200) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    statuses = [a[:12] for a in answers]
    assert set(statuses) == {b"HTTP/1.1 408", b"HTTP/1.1 503"}, answers
    _still_serves(base)
