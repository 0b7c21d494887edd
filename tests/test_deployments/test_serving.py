"""The served stack, end to end: real Ray, real Serve, real vLLM on CPU, real HTTP.

Everything talks to the one session app (``conftest.serve_stack``) through the
``openai`` client or plain HTTP, the way users do. The disagreement tests at the
end use the second app (``conftest.mixed_app``), started once.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from tests.support.stack import MIXED_APP, ODD_RANK, Stack

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(serve_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_stack.url, api_key="unused", timeout=120,
                         max_retries=0)


def greedy(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    params: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": 8,
                              "temperature": 0.0}
    return client.completions.create(**(params | kwargs))


# ------------------------------------------------------------------ OpenAI API


def test_models_lists_the_served_model(client: openai.OpenAI, serve_stack: Stack) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [serve_stack.model]


def test_completion(client: openai.OpenAI, serve_stack: Stack) -> None:
    started = time.monotonic()
    out = greedy(client, serve_stack.model)
    print(f"completion latency {time.monotonic() - started:.2f}s")
    assert out.model == serve_stack.model
    assert len(out.choices) == 1 and isinstance(out.choices[0].text, str)
    assert out.usage.prompt_tokens > 0
    assert 0 < out.usage.completion_tokens <= 8


def test_chat_completion(client: openai.OpenAI, serve_stack: Stack) -> None:
    out = client.chat.completions.create(
        model=serve_stack.model, messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6, temperature=0.0)
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens <= 6
    assert out.choices[0].finish_reason in ("stop", "length")


def test_streaming_chat_reports_usage(client: openai.OpenAI, serve_stack: Stack) -> None:
    stream = client.chat.completions.create(
        model=serve_stack.model, messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5, temperature=0.0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1, "include_usage gives exactly one usage chunk"
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert usage[0].completion_tokens == 5
    assert usage[0].total_tokens == usage[0].prompt_tokens + 5
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length"


def test_n_2_gives_two_choices(client: openai.OpenAI, serve_stack: Stack) -> None:
    out = client.completions.create(model=serve_stack.model, prompt=PROMPT, max_tokens=4,
                                    n=2, temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens <= 8


def test_max_tokens_is_honoured(client: openai.OpenAI, serve_stack: Stack) -> None:
    out = greedy(client, serve_stack.model, max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    assert out.choices[0].finish_reason == "length"


def pick_stop(text: str) -> int:
    """Index of a character that first occurs there: stopping on it must cut the text there.

    Random weights repeat themselves, so the cut is often early; the first
    character (an empty result) is the fallback. Replacement characters are
    partial UTF-8 and never picked.
    """
    for i, ch in enumerate(text):
        if i and ch.strip() and ch != "\ufffd" and text.find(ch) == i:
            return i
    return 0


def test_stop_string_cuts_the_output(client: openai.OpenAI, serve_stack: Stack) -> None:
    full = greedy(client, serve_stack.model, max_tokens=16, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and text
    stop = text[pick_stop(text)]
    cut = greedy(client, serve_stack.model, max_tokens=16, stop=[stop],
                 extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]


def test_greedy_and_seeded_sampling_repeat(client: openai.OpenAI, serve_stack: Stack) -> None:
    # Several calls: round-robin sends them to both replicas, so this also shows
    # the replicas compute the same thing.
    greedy_texts = {greedy(client, serve_stack.model).choices[0].text for _ in range(4)}
    assert len(greedy_texts) == 1
    seeded = {
        greedy(client, serve_stack.model, temperature=1.0, seed=1234).choices[0].text
        for _ in range(4)
    }
    assert len(seeded) == 1


# ---------------------------------------------------------------- bad requests


def assert_openai_error(response: httpx.Response, status: int | tuple[int, ...]) -> None:
    statuses = (status,) if isinstance(status, int) else status
    assert response.status_code in statuses, response.text
    body = response.json()
    error = body.get("error", body)
    assert isinstance(error.get("message"), str) and error["message"], body


@pytest.fixture(scope="module")
def http(serve_stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=serve_stack.url, timeout=120)


def test_bad_requests_get_openai_errors_and_replicas_keep_serving(
    http: httpx.Client, client: openai.OpenAI, serve_stack: Stack
) -> None:
    ok = {"model": serve_stack.model, "prompt": PROMPT, "max_tokens": 2}
    assert_openai_error(http.post("/completions", json=ok | {"model": "no-such-model"}),
                        (400, 404))
    assert_openai_error(
        http.post("/completions", content=b'{"model": "x", "prompt": ',
                  headers={"Content-Type": "application/json"}), (400, 422))
    too_long = "hello " * 3000  # > max_model_len 2048 tokens
    assert_openai_error(http.post("/completions", json=ok | {"prompt": too_long}), 400)
    assert_openai_error(http.post("/completions", json=ok | {"max_tokens": -1}), (400, 422))
    assert_openai_error(
        http.post("/chat/completions",
                  json={"model": serve_stack.model, "messages": "not a list"}), (400, 422))
    # Both replicas still answer (round-robin), and the fleet still agrees.
    for _ in range(4):
        assert http.post("/completions", json=ok).status_code == 200
    report = http.get("/kv-spec", params={"refresh": "true"}).json()
    assert report["agree"] and report["answered"] == 2


# ------------------------------------------------------------------ /v1/kv-spec


def test_kv_spec_agrees_on_fp8_ds_mla(http: httpx.Client) -> None:
    response = http.get("/kv-spec", params={"refresh": "true"})
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["agree"] is True and report["state"] == "agree"
    assert report["policy"] == "enforce"
    assert report["expected"]["layout"] == "fp8_ds_mla"
    # Judged against the byte model's prediction from the tiny model's config.json: the
    # real engines' main and indexer caches equal it layer for layer.
    assert report["expected"]["reference"] == "prediction"
    assert report["running_replicas"] == report["answered"] == 2
    assert report["problems"] == []
    replicas = report["replicas"]
    assert len({r["id"] for r in replicas}) == 2
    assert len({r["fingerprint"] for r in replicas}) == 1
    for rep in replicas:
        assert rep["cache_dtype"] == "fp8_ds_mla"
        assert rep["kv_cache_dtype_requested"] == "auto"
        assert rep["kv_cache_dtype_engine"] == "fp8"
        assert rep["page_sizes"] and all(p % 576 == 0 for p in rep["page_sizes"])
        assert rep["status"] == "ok" and rep["action"] == "serve"
        assert rep["predicted_fingerprint"] and rep["node_id"]


def test_kv_spec_cached_read_matches_refresh(http: httpx.Client) -> None:
    fresh = http.get("/kv-spec", params={"refresh": "true"}).json()
    cached = http.get("/kv-spec").json()
    assert cached["expected"]["fingerprint"] == fresh["expected"]["fingerprint"]
    assert cached["checked_at"] >= fresh["checked_at"]


def test_status_cli_reads_the_verdict(serve_stack: Stack, capsys: pytest.CaptureFixture) -> None:
    import argparse

    from deployments.cli import status

    parser = argparse.ArgumentParser()
    status.add_arguments(parser)
    rc = status.main(parser.parse_args(["--url", serve_stack.url, "--refresh"]))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "KV spec: agree" in out and "fp8_ds_mla" in out


# -------------------------------------------------------------- disagreement


def _mixed_report(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/kv-spec", params={"refresh": "true"}, timeout=120).json()


def test_differing_replica_is_named_and_warn_keeps_serving(mixed_app: str) -> None:
    response = httpx.get(f"{mixed_app}/kv-spec", params={"refresh": "true"}, timeout=120)
    assert response.status_code == 409, response.text
    report = response.json()
    assert report["agree"] is False and report["state"] == "disagree"
    assert report["policy"] == "warn"
    by_rank = {r["rank"]: r for r in report["replicas"]}
    assert set(by_rank) == {0, 1}
    odd, good = by_rank[ODD_RANK], by_rank[1 - ODD_RANK]
    assert odd["status"] == "odd" and good["status"] == "ok"
    assert odd["cache_dtype"] == good["cache_dtype"] == "fp8_ds_mla"
    # The same multiset of caches (the old fingerprint said agree), not layer for layer.
    assert odd["page_sizes"] == good["page_sizes"]
    assert odd["fingerprint"] != good["fingerprint"]
    assert good["fingerprint"] == report["expected"]["fingerprint"]
    assert report["expected"]["reference"] == "prediction"
    assert list(report["odd_replicas"]) == [odd["id"]]
    [problem] = report["problems"]
    assert problem["kind"] == "prediction" and problem["replica"] == odd["id"]
    layers = {d["layer"] for d in problem["layers"]}
    assert {"model.layers.2.attn", "model.layers.3.attn"} <= layers, problem
    assert "canary" in problem["message"] and "model.layers.2.attn" in problem["message"]

    # Under warn the odd replica keeps serving: it stays RUNNING through several
    # health-check periods and requests keep succeeding.
    client = openai.OpenAI(base_url=mixed_app, api_key="unused", timeout=120, max_retries=0)
    for _ in range(4):
        out = client.completions.create(model="dsv4-tiny", prompt=PROMPT, max_tokens=2)
        assert out.usage.completion_tokens <= 2
    time.sleep(15)
    again = _mixed_report(mixed_app)
    assert odd["id"] in {r["id"] for r in again["replicas"]}
    assert again["running_replicas"] == 2


def _set_policy(policy: str, capsys: pytest.CaptureFixture) -> int:
    """``dsv4-serve policy POLICY --app MIXED_APP`` in this (Ray-attached) process."""
    import argparse

    from deployments.cli import policy as policy_cli

    parser = argparse.ArgumentParser()
    policy_cli.add_arguments(parser)
    rc = policy_cli.main(parser.parse_args([policy, "--app", MIXED_APP]))
    out = capsys.readouterr().out
    assert f"policy {policy_cli.override_of(policy) or 'warn'}" in out, out
    return rc


def test_enforce_makes_the_differing_replica_unhealthy(mixed_app: str,
                                                       capsys: pytest.CaptureFixture) -> None:
    from ray import serve

    before = _mixed_report(mixed_app)
    odd_id = next(iter(before["odd_replicas"]))
    # The operator's route (the app was deployed under warn): no replica restarts.
    assert _set_policy("enforce", capsys) == 1  # disagree
    after = _mixed_report(mixed_app)
    assert after["policy"] == after["policy_override"] == "enforce"
    assert odd_id in after["odd_replicas"]

    deadline = time.monotonic() + 120
    seen_unhealthy, replaced = False, False
    while time.monotonic() < deadline and not (seen_unhealthy and replaced):
        app = serve.status().applications[MIXED_APP]
        server = next(d for name, d in app.deployments.items() if name.startswith("DSv4Server"))
        seen_unhealthy |= server.status == "UNHEALTHY"
        ids = {r["id"] for r in _mixed_report(mixed_app)["replicas"]}
        replaced |= odd_id not in ids
        time.sleep(1)
    assert replaced, f"replica {odd_id} was not stopped under enforce"
    assert seen_unhealthy, "the deployment never reported UNHEALTHY"

    # The controller follows the replica set: Serve's replacement (a new replica
    # id, same rank, same override) is checked too, and named odd again.
    deadline = time.monotonic() + 300
    newcomer = None
    while time.monotonic() < deadline and newcomer is None:
        report = _mixed_report(mixed_app)
        newcomer = next((r for r in report["replicas"]
                         if r["id"] not in before["odd_replicas"] and r["rank"] == ODD_RANK),
                        None)
        time.sleep(2)
    assert newcomer is not None, "the replacement replica never answered the controller"
    assert newcomer["status"] == "odd" and report["state"] == "disagree"
    # Odd again with the same config: enforce backs off (drains it) instead of looping.
    assert newcomer["action"] == "drain" and newcomer["attempts"] == 1, newcomer

    # Cleared: each replica obeys its own configured policy (warn) again.
    _set_policy("configured", capsys)
    cleared = _mixed_report(mixed_app)
    assert cleared["policy"] == "warn" and cleared["policy_override"] is None
    assert {r["action"] for r in cleared["replicas"]} == {"serve"}, cleared["replicas"]
