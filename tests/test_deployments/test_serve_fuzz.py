"""Property-based fuzz of the HTTP API: bad input gets a 4xx, never a 5xx or a restart.

Hypothesis builds request bodies over the fields of the OpenAI completion and
chat requests (vLLM's ``CompletionRequest``/``ChatCompletionRequest``), mixing
valid values with wrong types, out-of-range numbers, unknown keys and broken
JSON, and posts them to the session stack (real Ray Serve LLM ingress, real
vLLM engines). Properties:

* every response is < 500 (a client error is the client's, not the server's);
* a 4xx carries an OpenAI-style error with a message;
* a 200 is a well-formed completion; a stream ends with ``[DONE]``;
* after all cases, the same replicas are RUNNING and agree (nothing restarted).

Bounded: ``MAX_EXAMPLES`` cases per endpoint, generation capped at 4 tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.serve_client import check, wait_agree
from tests.support.stack import Stack

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 40
MODEL = "dsv4-tiny"

junk = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                 st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(
                     st.text(max_size=5), st.integers(), max_size=2))


def field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly valid values, sometimes anything at all."""
    return st.one_of(valid, valid, junk)


COMMON = {
    "model": st.one_of(st.just(MODEL), st.just(MODEL), st.text(max_size=12), junk),
    "max_tokens": field(st.integers(0, 4)) | st.integers(-3, 10**7),
    "temperature": field(st.floats(0, 2)) | st.floats(-5, 1e6),
    "top_p": field(st.floats(0, 1)) | st.floats(-1, 3),
    "top_k": field(st.integers(-1, 50)),
    "n": field(st.integers(1, 2)) | st.integers(-2, 16),
    "seed": field(st.integers(0, 2**31)),
    "stop": field(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3))),
    "stream": field(st.booleans()),
    "presence_penalty": field(st.floats(-2, 2)),
    "frequency_penalty": field(st.floats(-2, 2)),
    "logit_bias": field(st.dictionaries(st.integers(0, 500).map(str), st.floats(-100, 100),
                                        max_size=2)),
    "min_tokens": field(st.integers(0, 3)),
    "unknown_field": junk,
}
COMPLETION = COMMON | {
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.text(max_size=10), max_size=3),
                        st.lists(st.integers(-10, 200000), max_size=8), junk),
    "echo": field(st.booleans()),
    "logprobs": field(st.integers(0, 5)) | st.integers(-3, 10**6),
    "suffix": field(st.text(max_size=5)),
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"]) | junk,
     "content": st.text(max_size=30) | junk})
CHAT = COMMON | {
    "messages": st.lists(message, max_size=3) | junk,
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(0, 5)) | st.integers(-3, 10**6),
    "tools": field(st.just([])) | st.lists(st.dictionaries(st.text(max_size=5), junk,
                                                            max_size=2), max_size=2),
    "response_format": field(st.just({"type": "text"})) | junk,
}


VALID_COMMON = {
    "max_tokens": st.integers(1, 4), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50), "n": st.integers(1, 2), "seed": st.integers(0, 2**31),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2),
    "stream": st.booleans(), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "min_tokens": st.integers(0, 1),
}
VALID_COMPLETION = VALID_COMMON | {
    "prompt": st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 1000), min_size=1,
                                                            max_size=8),
    "echo": st.booleans(), "logprobs": st.integers(0, 5),
}
VALID_CHAT = VALID_COMMON | {
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=30)}),
        min_size=1, max_size=3).map(lambda m: [*m, {"role": "user", "content": "hi"}]),
    "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
}


def body(fields: dict[str, st.SearchStrategy[Any]],
         valid: dict[str, st.SearchStrategy[Any]],
         required: str) -> st.SearchStrategy[dict[str, Any]]:
    """Half hostile (any subset of ``fields``), half well-formed but varied.

    The well-formed half reaches the engine (sampling, stop strings, logprobs,
    token-id prompts, streaming), where a crash would be a 5xx or a dead replica.
    """
    hostile = st.fixed_dictionaries({}, optional=fields)
    friendly = st.fixed_dictionaries({"model": st.just(MODEL), required: valid[required]},
                                     optional={k: v for k, v in valid.items() if k != required})
    return st.one_of(hostile, friendly)


def capped(req: dict[str, Any]) -> dict[str, Any]:
    """Keep generation tiny when the request would be valid: CI time, not coverage."""
    if isinstance(req.get("max_tokens"), int) and 4 < req["max_tokens"] < 2048:
        req["max_tokens"] = 4
    if "max_tokens" not in req:
        req["max_tokens"] = 4
    return req


@pytest.fixture(scope="module")
def http(serve_stack: Stack) -> Iterator[httpx.Client]:
    before = wait_agree(serve_stack.url, 2)
    with httpx.Client(base_url=serve_stack.url, timeout=120) as client:
        yield client
    after = wait_agree(serve_stack.url, 2, timeout_s=60)
    assert {r["id"] for r in after["replicas"]} == {r["id"] for r in before["replicas"]}, \
        "a replica was restarted during the fuzz"


FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@FUZZ
@given(req=body(COMPLETION, VALID_COMPLETION, "prompt"))
def test_fuzz_completions(http: httpx.Client, req: dict[str, Any]) -> None:
    req = capped(req)
    check(http.post("/completions", json=req), req)


@FUZZ
@given(req=body(CHAT, VALID_CHAT, "messages"))
def test_fuzz_chat_completions(http: httpx.Client, req: dict[str, Any]) -> None:
    req = capped(req)
    check(http.post("/chat/completions", json=req), req)


@FUZZ
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode),
       path=st.sampled_from(["/completions", "/chat/completions"]),
       ctype=st.sampled_from(["application/json", "text/plain", "application/x-www-form"]))
def test_fuzz_raw_bodies(http: httpx.Client, raw: bytes, path: str, ctype: str) -> None:
    check(http.post(path, content=raw, headers={"Content-Type": ctype}), raw)


@pytest.mark.parametrize("messages", [None, 5, "not a list"])
def test_chat_messages_not_a_list_is_a_client_error(http: httpx.Client, messages: Any) -> None:
    """vLLM's chat model crashed on a non-list ``messages`` (500); now a 400 naming it."""
    req = {"model": MODEL, "messages": messages, "max_tokens": 2}
    resp = http.post("/chat/completions", json=req)
    check(resp, req)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages", resp.text
