"""The HTTP edge on the live session stack: keys, hostile bodies, overload, disconnects.

Runs against ``conftest.serve_stack`` (``configs/local-cpu.yaml``: 127.0.0.1, policy
enforce, 2 replicas of the tiny DeepSeek-V4, real Ray Serve LLM ingress and vLLM
engines). The session's ingress reads its keys from ``Stack.keys_file``, which says
``none`` (so the loopback app is open, as ``make run`` is for a new user); the auth
tests write keys there, which the ingress picks up within a second (the rotation
path a mounted Kubernetes Secret takes), and write ``none`` again.

Every test leaves the same 2 replicas RUNNING and agreeing (checked around the
module): a hostile client must not restart anything. Bounded: hypothesis runs
``MAX_EXAMPLES`` cases per strategy; the overload burst is ``BURST`` requests of
4 tokens; the disconnect test streams at most ``STREAM_TOKENS`` tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any, cast

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deployments.config import DEFAULT_CONFIG, load_serve_config
from deployments.http import auth
from tests.support.serve_client import check, wait_agree
from tests.support.stack import Stack

pytestmark = pytest.mark.slow

MODEL = "dsv4-tiny"
KEY = "live-test-key-" + "a" * 16
NEW_KEY = "live-test-key-" + "b" * 16
MAX_EXAMPLES = 25
BURST = 96
STREAM_TOKENS = 1000


@pytest.fixture(scope="module")
def edge_settings(serve_stack: Stack) -> Any:
    [(_, args)] = serve_stack.config.ours()
    return args.http


@pytest.fixture(scope="module")
def http(serve_stack: Stack) -> Iterator[httpx.Client]:
    """A client of the session app; the same replicas must be there afterwards."""
    def replica_ids(timeout_s: float) -> set[str]:
        report = wait_agree(serve_stack.url, 2, timeout_s=timeout_s)
        return {r["id"] for r in report["replicas"]}

    before = replica_ids(300)
    with httpx.Client(base_url=serve_stack.url, timeout=120) as client:
        yield client
    assert replica_ids(60) == before, "a replica was restarted by a client"


def set_keys(stack: Stack, *keys: str, raw: bytes | None = None) -> None:
    """Write ``keys`` (none: the file says ``none``, no key on purpose) or ``raw`` bytes."""
    assert stack.keys_file is not None
    if raw is None:
        raw = "".join(f"{k}\n" for k in keys or (auth.NO_KEYS,)).encode()
    stack.keys_file.write_bytes(raw)
    time.sleep(auth.FILE_RECHECK_S + 0.5)  # the ingress looks at the file once a second


# ------------------------------------------------------------------ keys


def test_api_keys_live_without_wrong_right_and_rotated(serve_stack: Stack,
                                                       http: httpx.Client) -> None:
    completion = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    try:
        set_keys(serve_stack, KEY)
        for method, path, body in [("GET", "/models", None), ("POST", "/completions", completion),
                                   ("POST", "/chat/completions", {"model": MODEL, "messages": [
                                       {"role": "user", "content": "Hi"}], "max_tokens": 1}),
                                   ("GET", "/kv-spec", None)]:
            for headers in ({}, {"Authorization": f"Bearer {NEW_KEY}"}):
                resp = http.request(method, path, json=body, headers=headers)
                assert resp.status_code == 401, (path, headers, resp.text)
                error = resp.json()["error"]
                assert error["type"] == "authentication_error" and "Bearer" in error["message"]
                assert resp.headers["www-authenticate"] == "Bearer"
        # Serve's proxy's own route table needs the same key; its health check stays
        # open for probes (KubeRay's readiness probe)
        proxy = f"http://127.0.0.1:{serve_stack.config.http_options.port}"
        assert httpx.get(f"{proxy}/-/routes", timeout=30).status_code == 401
        assert httpx.get(f"{proxy}/-/routes", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=30).status_code == 200
        assert httpx.get(f"{proxy}/-/healthz", timeout=30).status_code == 200
        # the right key through the official client, as README shows it
        client = openai.OpenAI(base_url=serve_stack.url, api_key=KEY, max_retries=0)
        out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        assert out.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=serve_stack.url, api_key=NEW_KEY,
                          max_retries=0).models.list()
        # rotation: both keys while clients move, then the old one is gone
        set_keys(serve_stack, KEY, NEW_KEY)
        for key in (KEY, NEW_KEY):
            assert http.get("/models", headers={"Authorization": f"Bearer {key}"}
                            ).status_code == 200
        set_keys(serve_stack, NEW_KEY)
        assert http.get("/models", headers={"Authorization": f"Bearer {KEY}"}
                        ).status_code == 401
        assert http.get("/kv-spec", headers={"Authorization": f"Bearer {NEW_KEY}"}
                        ).status_code == 200
    finally:
        set_keys(serve_stack)
    assert http.get("/models").status_code == 200, "the loopback app did not reopen"


def test_startup_is_refused_beyond_loopback_without_a_key(serve_stack: Stack) -> None:
    """The rule the ingress applies where it starts, checked before Ray starts by ``run``."""
    config = serve_stack.config.model_copy(deep=True)
    config.http_options.host = "0.0.0.0"
    with pytest.raises(auth.AuthConfigError, match="answers beyond this machine"):
        auth.preflight(config, environ={})
    auth.preflight(config, environ={"DSV4_API_KEYS": KEY})
    auth.preflight(load_serve_config(DEFAULT_CONFIG), environ={})  # make run: no key needed


# ------------------------------------------------------------------ hostile bodies


FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                 max_size=3),
    max_leaves=40)


def nested(depth: int, kind: str) -> str:
    return ("[" * depth + "]" * depth) if kind == "list" else ('{"a":' * depth + "1"
                                                                + "}" * depth)


@FUZZ
@given(extra=json_values, depth=st.integers(1, 2000), kind=st.sampled_from(["list", "dict"]),
       path=st.sampled_from(["/completions", "/chat/completions"]))
def test_fuzz_nesting_depth(http: httpx.Client, edge_settings: Any, extra: Any, depth: int,
                            kind: str, path: str) -> None:
    """An extra field nested up to 2000 deep: 400 above the limit, never a 5xx."""
    first = ('"prompt": "Hi"' if path == "/completions"
             else '"messages": [{"role": "user", "content": "Hi"}]')
    raw = (f'{{"model": "{MODEL}", {first}, "max_tokens": 1, "x": {json.dumps(extra)}, '
           f'"deep": {nested(depth, kind)}}}').encode()
    resp = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    check(resp, raw[:200])
    if depth + 1 > edge_settings.max_json_depth:
        assert resp.status_code == 400 and "max_json_depth" in resp.text, resp.text


@FUZZ
@given(size=st.integers(0, 3 << 20), chunked=st.booleans())
def test_fuzz_body_size(http: httpx.Client, edge_settings: Any, size: int,
                        chunked: bool) -> None:
    """Bodies up to 3 MiB, with or without Content-Length: 413 above the limit."""
    raw = (f'{{"model": "{MODEL}", "max_tokens": 1, "prompt": "Hi", "pad": "'.encode()
           + b"x" * size + b'"}')
    content: Any = raw if not chunked else iter([raw[i:i + 65536]
                                                 for i in range(0, len(raw), 65536)])
    resp = http.post("/completions", content=content,
                     headers={"Content-Type": "application/json"})
    check(resp, len(raw))
    if len(raw) > edge_settings.max_body_bytes:
        assert resp.status_code == 413 and "max_body_bytes" in resp.text, resp.text


@pytest.mark.parametrize(("field", "value", "limit"), [
    ("n", 5000, "http.max_n=4"), ("max_tokens", 10**7, "http.max_tokens=1024")])
def test_n_and_max_tokens_limits_live(http: httpx.Client, field: str, value: int,
                                      limit: str) -> None:
    resp = http.post("/completions", json={"model": MODEL, "prompt": "Hi", field: value})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and limit in error["message"]


@pytest.mark.parametrize("path", ["/embeddings", "/score", "/audio/transcriptions"])
def test_unserved_routes_answer_404_without_reading_the_body(http: httpx.Client,
                                                             path: str) -> None:
    big = b"x" * (8 << 20)  # far above max_body_bytes: a read would be a 413
    resp = http.post(path, content=big, headers={"Content-Type": "multipart/form-data; b=x"})
    assert resp.status_code == 404, resp.text
    assert "is closed on this server" in resp.json()["error"]["message"]
    root = str(http.base_url).removesuffix("/v1/")
    assert httpx.post(f"{root}/collective_rpc", json={"method": "x"}).status_code == 404


def test_the_600_deep_chat_body_is_a_400_not_a_500(http: httpx.Client) -> None:
    """The measured case of the issue: 1.3 KB of chat with one extra field 600 deep."""
    raw = (f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Hi"}}], '
           f'"extra": {nested(600, "list")}}}').encode()
    resp = http.post("/chat/completions", content=raw,
                     headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and "max_json_depth" in resp.text, resp.text


def test_twenty_concurrent_refreshes_run_one_check(serve_stack: Stack, http: httpx.Client,
                                                   edge_settings: Any) -> None:
    async def refreshes() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=serve_stack.url, timeout=120) as client:
            return list(await asyncio.gather(*[client.get("/kv-spec?refresh=true")
                                               for _ in range(20)]))

    time.sleep(edge_settings.kv_spec_refresh_interval_s + 0.2)  # past the rate limit
    before = time.time()
    answers = asyncio.run(refreshes())
    assert {r.status_code for r in answers} == {200}
    # Each serving replica is an ingress with its own gate: at most one check per replica.
    replicas = answers[0].json()["running_replicas"]
    checks = {r.json()["checked_at"] for r in answers}
    assert 1 <= len(checks) <= replicas, f"{len(checks)} checks ran for {replicas} replicas"
    assert min(checks) >= before - 1
    hows = sorted(r.headers["x-dsv4-refresh"] for r in answers)
    assert 1 <= hows.count("ran") <= replicas, hows
    assert set(hows) <= {"ran", "coalesced", "rate-limited"}, hows
    text = answers[0].text
    assert '"pid"' not in text and "/home/" not in text and "Traceback" not in text


# ------------------------------------------------------------------ overload


def test_overload_is_503_with_retry_after_and_admitted_requests_complete(
        serve_stack: Stack, http: httpx.Client, edge_settings: Any) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=serve_stack.url, timeout=300,
                                     limits=httpx.Limits(max_connections=BURST)) as client:
            body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4}
            return list(await asyncio.gather(*[client.post("/completions", json=body)
                                               for _ in range(BURST)]))

    assert BURST >= 3 * edge_settings.max_in_flight
    started = time.monotonic()
    answers = asyncio.run(burst())
    codes = sorted(r.status_code for r in answers)
    print(f"overload: {BURST} concurrent, bound {edge_settings.max_in_flight}: "
          f"{codes.count(200)} x 200, {codes.count(503)} x 503 in "
          f"{time.monotonic() - started:.1f} s")
    assert set(codes) <= {200, 503}, codes
    assert codes.count(503) >= BURST - 2 * edge_settings.max_in_flight
    assert codes.count(200) >= 1
    for resp in answers:
        if resp.status_code == 503:
            assert int(resp.headers["retry-after"]) >= 1
        else:
            assert resp.json()["choices"][0]["text"] is not None


# ------------------------------------------------------------------ disconnect


def _unfinished(replica: Any) -> int:
    """Run inside a server replica actor: its vLLM front-end's unfinished requests."""
    server = replica._replica_impl._user_callable_wrapper._callable  # the DSv4Server
    return server.engine._engine_client.output_processor.get_num_unfinished_requests()


def engine_requests_running() -> int:
    """Requests the vLLM engines of the app's server replicas still hold, summed.

    Read in each replica process (``__ray_call__``, Ray's run-on-this-actor hook) from
    vLLM's own bookkeeping (``OutputProcessor``): an aborted request leaves it at
    once, a request still generating stays. Serve's own ongoing counts would only
    say the handler returned, not that the engine stopped.
    """
    import ray
    from ray.serve._private.common import ReplicaID

    from deployments.serving.names import serves_http

    actors = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if not ReplicaID.is_full_id_str(actor["name"]):
            continue
        deployment = ReplicaID.from_full_id_str(actor["name"]).deployment_id
        if deployment.app_name == "dsv4" and serves_http(deployment.name):
            actors.append(ray.get_actor(actor["name"], namespace=actor["namespace"]))
    assert actors, "no server replica actors found"
    return sum(ray.get([a.__ray_call__.remote(_unfinished) for a in actors], timeout=30))


def wait_for(predicate: Any, timeout_s: float, what: str) -> float:
    deadline, started = time.monotonic() + timeout_s, time.monotonic()
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout_s}s")


def test_client_disconnect_aborts_the_generation_in_the_engine(serve_stack: Stack,
                                                               http: httpx.Client) -> None:
    wait_for(lambda: engine_requests_running() == 0, 60, "an idle engine")
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": STREAM_TOKENS,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=serve_stack.url, timeout=60) as client, \
            client.stream("POST", "/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        started = time.monotonic()
        chunks = sum(1 for _, line in zip(range(20), lines, strict=False) if line)
        rate = chunks / (time.monotonic() - started)  # tokens per second, roughly
        assert engine_requests_running() == 1, "the stream is not in an engine"
    # closed with ~980 tokens to go: the engine must drop it long before they are done
    dropped = wait_for(lambda: engine_requests_running() == 0, 30,
                       "the engine dropping the request after the client left")
    remaining_s = (STREAM_TOKENS - chunks) / rate
    print(f"disconnect: engine dropped the request {dropped:.2f} s after the close "
          f"(~{remaining_s:.0f} s of generation were left at {rate:.0f} tok/s)")
    assert dropped < remaining_s / 2, (dropped, remaining_s)


# ------------------------------------------------------------------ issue 32's ways around


@pytest.mark.parametrize("path", ["/chat/completions", "/responses", "/messages"])
def test_nested_transfer_params_are_refused_live(http: httpx.Client, path: str) -> None:
    """``vllm_xargs.kv_transfer_params = 0`` reached NIXL's scheduler through
    ``SamplingParams.extra_args`` and killed the P/D decode engine."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "input": "Hi",
            "max_tokens": 2, "vllm_xargs": {"kv_transfer_params": 0}}
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert "vllm_xargs.kv_transfer_params" in resp.text and "remove" in resp.text
    ok = http.post("/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "Hi"}]})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/chat/completions", {"thinking_token_budget": "5000"}, "thinking_token_budget"),
    ("/chat/completions", {"repetition_detection": {"max_pattern_size": 10**6,
                                                    "min_count": 2}},
     "repetition_detection.max_pattern_size"),
    ("/completions", {"prompt": "Hi", "thinking_token_budget": 5000.0},
     "thinking_token_budget"),
    ("/messages", {"max_tokens": 10**6}, "max_tokens"),
])
def test_costly_fields_are_bounded_where_vllm_reads_them_live(
        http: httpx.Client, path: str, body: dict[str, Any], param: str) -> None:
    resp = http.post(path, json={"model": MODEL, "messages": [
        {"role": "user", "content": "Hi"}], **body})
    assert resp.status_code == 400, resp.text
    payload = resp.json()
    if path == "/messages":  # Anthropic's protocol, Anthropic's error shape
        assert payload["type"] == "error" and param in payload["error"]["message"]
    else:
        assert payload["error"]["param"] == param and "http.max_tokens" in resp.text


@pytest.mark.parametrize("path", ["/checkpoint/prepare", "/v1/fault_tolerance/apply"])
def test_vllm_operator_routes_are_closed_live(http: httpx.Client, path: str) -> None:
    root = str(http.base_url).removesuffix("/v1/")
    resp = httpx.post(f"{root}{path}", json={})
    assert resp.status_code == 404 and "is closed on this server" in resp.text, resp.text


def test_a_key_file_read_without_a_key_keeps_the_last_good_set_live(
        serve_stack: Stack, http: httpx.Client) -> None:
    """``cat > keys`` empties the file first: that must not open the loopback app, nor
    must a half-written key count."""
    good = {"Authorization": f"Bearer {KEY}"}
    url = f"{str(http.base_url).rstrip('/')}/models"

    def statuses(headers: dict[str, str]) -> set[int]:
        """Over fresh connections: the kernel spreads them over both replicas, and each
        replica judges the file when a request (or its health check) looks at it."""
        return {httpx.get(url, headers=headers).status_code for _ in range(12)}

    try:
        set_keys(serve_stack, KEY)
        assert statuses(good) == {200}  # every replica has loaded the good set
        for raw in (b"", b"k\n", KEY[:10].encode()):
            set_keys(serve_stack, raw=raw)
            assert statuses({}) == {401}, raw
            assert statuses(good) == {200}, raw
    finally:
        set_keys(serve_stack)
    assert http.get("/models").status_code == 200, "the loopback app did not reopen"


def test_uploads_in_progress_hold_in_flight_slots_live(http: httpx.Client,
                                                       edge_settings: Any) -> None:
    """64 stalled uploads fill both replicas' shares of ``http.max_in_flight`` (32):
    the next request is a 503 until their ``http.body_timeout_s`` frees the slots."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(str(http.base_url))
    head = (f"POST {url.path.rstrip('/')}/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"pr")
    stalled = []
    try:
        for _ in range(2 * edge_settings.max_in_flight):
            sock = socket.create_connection((url.hostname, cast(int, url.port)), timeout=30)
            sock.sendall(head.encode())
            stalled.append(sock)
        time.sleep(1.0)
        resp = http.post("/completions", json={"model": MODEL, "prompt": "Hi",
                                               "max_tokens": 1})
        assert resp.status_code == 503 and "http.max_in_flight" in resp.text, resp.text
        assert "retry-after" in resp.headers
        time.sleep(edge_settings.body_timeout_s + 2)
        answers = [s.recv(4096)[:12] for s in stalled]
        # each upload held a slot until its deadline (408); those beyond a replica's
        # share were refused at once (503), before their body was read
        timed_out = answers.count(b"HTTP/1.1 408")
        assert timed_out + answers.count(b"HTTP/1.1 503") == len(answers), answers
        assert timed_out >= edge_settings.max_in_flight // 2, answers
    finally:
        for sock in stalled:
            sock.close()
    resp = http.post("/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert resp.status_code == 200, resp.text
