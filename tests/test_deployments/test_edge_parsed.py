"""The edge decides on the value vLLM's own request model parses (issue 52): a differential test.

Hypothesis builds request bodies whose judged fields (``fields.judged``: every bound and
store gate of the route) carry lax-equivalent encodings of a value (``"256"``, ``256.0``,
``" 256 "``, ``true`` for 1; ``1``, ``"yes"``, ``"on"``, ``1.0`` for true; ``null``; junk),
written as raw JSON text with escaped and duplicated keys. For each body it compares the
edge's verdict (``parsed.judge`` and the Responses id the admission assigns) with the
verdict on vLLM's real request model's parse of the same bytes, and checks that the bytes
the edge passes on parse, in vLLM's model, to the very values the edge judged.

Examples per protocol: ``DSV4_DIFFERENTIAL_EXAMPLES`` (default 200 in ``make test``;
``make test-differential`` runs 10,000).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deployments.config import HTTPEdge
from deployments.http import bounds, fields, routes
from deployments.http.admission import AdmissionMiddleware, Slots
from deployments.http.parsed import judge
from deployments.http.refusal import Refusal

pytest.importorskip("vllm")
from tests.support import vllm_fields

EXAMPLES = int(os.environ.get("DSV4_DIFFERENTIAL_EXAMPLES", "200"))
LIMITS = {"max_n": 4, "max_tokens": 64, "max_logprobs": 5, "max_prompt_logprobs": 5000}
MESSAGE = [{"role": "user", "content": "hi"}]
# protocol -> (route, vLLM model, base body)
PROTOCOLS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "chat": (routes.CHAT_ROUTE, "ChatCompletionRequest", {"model": "m", "messages": MESSAGE}),
    "batch": (routes.CHAT_BATCH_ROUTE, "BatchChatCompletionRequest",
              {"model": "m", "messages": [MESSAGE]}),
    "completions": (routes.COMPLETIONS_ROUTE, "CompletionRequest",
                    {"model": "m", "prompt": "hi " * 300}),
    "responses": (routes.RESPONSES_ROUTE, "ResponsesRequest", {"model": "m", "input": "hi"}),
    "messages": (routes.MESSAGES_ROUTE, "AnthropicMessagesRequest",
                 {"model": "m", "max_tokens": 16, "messages": MESSAGE}),
}
_MODELS: dict[str, type] = {}
_JUNK = st.sampled_from(["abc", "1e3", "0x10", "", [], {}, [1], 2.5, -0.5, "nan", " true "])


def model(name: str) -> Any:
    if not _MODELS:
        _MODELS.update(vllm_fields.installed_models())
    return _MODELS[name]


def int_encodings(value: int) -> st.SearchStrategy[Any]:
    forms: list[Any] = [value, str(value), float(value), f" {value} ", f"{value}.0"]
    if value in (0, 1):
        forms += [bool(value)]
    if abs(value) >= 1000:
        forms += [f"{value:_}"]
    if value >= 0:
        forms += [f"+{value}", f"0{value}"]
    return st.sampled_from(forms)


TRUE = [True, 1, 1.0, "true", "True", "TRUE", "1", "yes", "on", "t", "y"]
FALSE = [False, 0, 0.0, "false", "0", "no", "off", "f", "n"]


def encoded(kind: str, limit: int) -> st.SearchStrategy[Any]:
    """A lax-equivalent encoding of a value of ``kind`` around ``limit``, null or junk."""
    if kind == "int":
        values = st.one_of(st.integers(-3, 2 * limit + 3), st.sampled_from([10**6, 10**12]))
        main = values.flatmap(int_encodings)
    elif kind == "bool":
        main = st.sampled_from(TRUE + FALSE + [2, -1, "maybe"])
    else:
        main = st.sampled_from(["resp_abc", "", 123, 1.5, True])
    return st.one_of(main, main, main, st.none(), _JUNK)


def _key(name: str, escape: bool) -> str:
    """A JSON key, its first letter \\u-escaped when asked (same key once decoded)."""
    text = json.dumps(name)
    return f'"\\u{ord(name[0]):04x}{text[2:]}' if escape else text


@st.composite
def bodies(draw: st.DrawFn, protocol: str) -> bytes:
    """A raw JSON body: the base fields, then a draw of the judged fields, some keys
    escaped, some sent twice (the last one counts, for the edge and for vLLM)."""
    path, model_name, base = PROTOCOLS[protocol]
    declared_fields = set(model(model_name).model_fields)
    if model_name == "BatchChatCompletionRequest":  # each conversation's request reads them
        declared_fields |= set(model("ChatCompletionRequest").model_fields)
    route = routes.EXACT[path]
    nested: dict[str, list[tuple[str, Any]]] = {}
    top: list[tuple[str, Any]] = list(base.items())
    for field_path, kind in fields.judged(route).items():
        # A field this release's model does not declare (a later release's) is skipped.
        declared = field_path.split(".")[0] in declared_fields
        if not declared or not draw(st.booleans()):
            continue
        limit = LIMITS.get(route.bounds.get(field_path, ""), 8)
        times = draw(st.integers(1, 2))
        for _ in range(times):
            item = draw(encoded(kind, limit))
            parent, _, key = field_path.rpartition(".")
            (nested.setdefault(parent, []) if parent else top).append((key, item))
    for parent, items in nested.items():
        if parent == "thinking":
            items = [("type", "enabled"), *items]
        top.append((parent, _Raw(items)))
    return _encode(top, draw).encode()


class _Raw:
    """An object written field by field (keys may repeat)."""

    def __init__(self, items: list[tuple[str, Any]]):
        self.items = items


def _encode(items: list[tuple[str, Any]], draw: st.DrawFn) -> str:
    parts = []
    for name, value in items:
        text = _encode(value.items, draw) if isinstance(value, _Raw) else json.dumps(value)
        parts.append(f"{_key(name, draw(st.booleans()))}: {text}")
    return "{" + ", ".join(parts) + "}"


# ------------------------------------------------------------------ the two verdicts


def _value(request: Any, path: str) -> Any:
    value = request
    for part in path.split("."):
        value = getattr(value, part, None) if not isinstance(value, dict) else value.get(part)
    return value


def vllm_verdict(name: str, raw: bytes, route: routes.Route,
                 edge: HTTPEdge) -> tuple[str, Any]:
    """What vLLM's parse of ``raw`` says: ("invalid",), ("refused", field) for the first
    bound or store gate its values break (the edge's order), else ("ok", values)."""
    try:
        request = model(name).model_validate(json.loads(raw))
        if name == "BatchChatCompletionRequest":  # what vLLM runs: one request each
            request = request.to_chat_completion_request(request.messages[0])
    except Exception:  # any refusal of vLLM's model: its 400
        return "invalid", None
    judged = fields.judged(route)
    for path, limit_name in route.bounds.items():
        value = _value(request, path)
        if value is not None and value > getattr(edge, limit_name):
            return "refused", path
    if route.echo_logprobs is not None:  # as vLLM's to_sampling_params picks k
        param, k = "prompt_logprobs", request.prompt_logprobs
        if k is None and request.echo:
            param, k = "echo", getattr(request, route.echo_logprobs)
        tokens = bounds.prompt_tokens_at_most(json.loads(raw), route)
        if k is not None and k >= 0 and tokens * (k + 1) > edge.max_prompt_logprobs:
            return "refused", param
    if route.stateful and not edge.responses_store:
        set_ = request.model_fields_set
        for gate in fields.STORE_FIELDS:
            wants = (_value(request, gate) is not None if gate == "previous_response_id"
                     else gate in set_ and _value(request, gate) is True)
            if wants:
                return "refused", gate
    return "ok", {p: _value(request, p) for p in judged}


def edge_verdict(name: str, raw: bytes, route: routes.Route,
                 edge: HTTPEdge) -> tuple[tuple[str, Any], bytes]:
    """("refused", field) when the edge refuses; else what vLLM makes of the bytes the
    edge passes on, its bounds checked again ("passed-" + verdict, or "ok", values)."""
    judged = judge(raw, edge, route)
    if judged.problem:
        return ("refused", judged.problem[0]), raw
    admission = AdmissionMiddleware(None, edge, Slots(1))  # type: ignore[arg-type]  # only _assign_id is used
    try:
        sent, _ = admission._assign_id(route, judged.raw, judged.body)
    except Refusal as refusal:
        return ("refused", refusal.param), raw
    verdict = vllm_verdict(name, sent, route, edge)
    return (verdict if verdict[0] == "ok" else ("passed-" + verdict[0], verdict[1])), sent


NORMALIZED = {"count": 0, "refused_coerced": 0}


def check(protocol: str, raw: bytes, store: bool) -> None:
    """The edge refuses what vLLM's parse puts over a bound or gate, passes the rest with
    the values vLLM parsed, and never passes a value over a bound."""
    path, name, _ = PROTOCOLS[protocol]
    route = routes.EXACT[path]
    edge = HTTPEdge(**LIMITS, responses_store=store)
    want = vllm_verdict(name, raw, route, edge)
    got, sent = edge_verdict(name, raw, route, edge)
    assert got[0] != "passed-refused", (raw, sent, got)  # over a bound, yet passed on
    if want[0] == "invalid":
        # vLLM's model refuses the bytes: the edge refuses them first, passes them on
        # (vLLM's 400), or passes the value it coerced (a before-validator of vLLM's that
        # reads the raw value, like the batch route's ``n``, then sees the coerced one).
        NORMALIZED["count"] += got[0] == "ok"
        return
    if want[0] == "ok" and got[0] == "passed-invalid":
        # vLLM accepts the raw bytes and refuses the same values sent as the types it
        # parses them to: one of its validators reads the raw value (``"store": "false"``
        # is truthy there, False in its parse). The edge passed the value vLLM parses;
        # vLLM answers 400 and nothing runs.
        NORMALIZED["refused_coerced"] += 1
        return
    assert got == want, (raw, want, got)
    if want[0] == "ok" and store and route.stateful:  # a background run has the edge's id
        request = model(name).model_validate(json.loads(sent))
        assert (request.background is True) == (b'"request_id"' in sent), (raw, sent)


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_the_edge_decides_on_vllms_parsed_value(protocol: str) -> None:
    model(PROTOCOLS[protocol][1])
    started = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(raw=bodies(protocol), store=st.booleans())
    def run(raw: bytes, store: bool) -> None:
        check(protocol, raw, store)

    NORMALIZED.update(count=0, refused_coerced=0)
    run()
    print(f"{protocol}: {EXAMPLES} bodies in {time.monotonic() - started:.1f} s; "
          f"{NORMALIZED['count']} refused by vLLM raw, passed coerced; "
          f"{NORMALIZED['refused_coerced']} passed raw, refused coerced")


def test_vllms_raw_validator_disagreeing_with_its_parse() -> None:
    """Found by the differential run: ``"store": "false"`` with ``background: true``
    passes vLLM's raw check and parses to store=False; sent as parsed, vLLM refuses."""
    raw = b'{"model": "m", "input": "hi", "store": "false", "background": true}'
    check("responses", raw, True)
    assert NORMALIZED["refused_coerced"] >= 1


@pytest.mark.parametrize(("raw", "background"), [
    (b'{"input": "hi", "background": 1}', True),
    (b'{"input": "hi", "background": "yes"}', True),
    (b'{"input": "hi", "background": "true"}', True),
    (b'{"input": "hi", "background": 1.0}', True),
    (b'{"input": "hi", "backgroun\\u0064": "on"}', True),
    (b'{"input": "hi", "background": true, "background": 0}', False),
])
def test_a_lax_background_gets_the_edges_id_and_slot(raw: bytes, background: bool) -> None:
    """issue 52 HIGH: ``"background": 1`` ran outside every slot and deadline."""
    route = routes.EXACT[routes.RESPONSES_ROUTE]
    edge = HTTPEdge(responses_store=True)
    judged = judge(raw, edge, route)
    assert judged.problem is None
    sent, response_id = AdmissionMiddleware(None, edge, Slots(1))._assign_id(  # type: ignore[arg-type]  # only _assign_id is used
        route, judged.raw, judged.body)
    assert (response_id is not None) is background
    parsed = model("ResponsesRequest").model_validate(json.loads(sent))
    assert parsed.background is background
    if background:
        assert parsed.request_id == response_id
    off = judge(raw, HTTPEdge(), route)
    assert (off.problem is not None and off.problem[0] == "background") is background


def test_lax_ints_are_bounded_and_reach_vllm_as_judged() -> None:
    route = routes.EXACT[routes.COMPLETIONS_ROUTE]
    refused = judge(b'{"prompt": "x", "n": "  300 ", "max_tokens": 5.0}', HTTPEdge(), route)
    assert refused.problem is not None and refused.problem[0] == "n"
    passed = judge(b'{"prompt": "x", "n": "2", "max_tokens": 5.0}', HTTPEdge(), route)
    assert passed.problem is None and json.loads(passed.raw) == {
        "prompt": "x", "n": 2, "max_tokens": 5}


# ------------------------------------------------------------------ the coercion types


def _type_names(annotation: Any) -> set[str]:
    text = annotation if isinstance(annotation, str) else repr(annotation)
    text = text.replace("<class '", "").replace("'>", "")
    return {t for t in ("int", "bool", "str", "float") if f"{t}" in
            {w.strip("[]() ,|") for w in text.replace("|", " ").replace(",", " ").split()}}


def _installed_annotation(cls: Any, path: str) -> set[str]:
    import typing
    first, _, rest = path.partition(".")
    annotation = typing.get_type_hints(cls).get(first)
    if not rest:
        return _type_names(annotation)
    found: set[str] = set()
    for nested in vllm_fields._vllm_types(annotation):
        if rest.split(".")[0] in vllm_fields._own_fields(nested):
            found |= _installed_annotation(nested, rest)
    return found


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_each_judged_field_is_coerced_as_vllms_annotation_says(protocol: str) -> None:
    """The coercion type in the field table is the one vLLM's model declares."""
    path, name, _ = PROTOCOLS[protocol]
    cls = model(name)
    for field_path, kind in fields.judged(routes.EXACT[path]).items():
        if field_path.split(".")[0] not in cls.model_fields:  # a later release's field
            continue
        assert _installed_annotation(cls, field_path) == {kind}, (name, field_path)


@pytest.mark.releases
@pytest.mark.parametrize("release", ("0.29.0", "0.33.0", "0.34.0"))
def test_each_release_declares_the_judged_types(release: str) -> None:
    import ast
    index = vllm_fields._Index(vllm_fields.wheel_path(release))
    for protocol, (path, name, _) in PROTOCOLS.items():
        for field_path, kind in fields.judged(routes.EXACT[path]).items():
            classes: list[str] = [name]
            for part in field_path.split(".")[:-1]:
                classes = [n for c in classes for n in
                           index.names_in(index.fields(c).get(part, ast.Constant(None)))]
            last = field_path.split(".")[-1]
            found = {t for c in classes if last in index.fields(c)
                     for t in _type_names(ast.unparse(index.fields(c)[last]))}
            assert found in (set(), {kind}), (release, protocol, field_path, found)


# ------------------------------------------------------------------ prompt logprobs


@pytest.mark.parametrize(("path", "body", "param"), [
    (routes.COMPLETIONS_ROUTE, {"prompt": "x" * 170_000, "prompt_logprobs": 20},
     "prompt_logprobs"),
    (routes.COMPLETIONS_ROUTE, {"prompt": [7] * 170_000, "prompt_logprobs": "20"},
     "prompt_logprobs"),
    (routes.COMPLETIONS_ROUTE, {"prompt": "x" * 170_000, "echo": "yes", "logprobs": 5.0},
     "echo"),
    (routes.CHAT_ROUTE, {"messages": [{"role": "user", "content": "x" * 170_000}],
                         "echo": 1, "top_logprobs": 3}, "echo"),
    (routes.CHAT_BATCH_ROUTE, {"messages": [[{"role": "user", "content": "x" * 20_000}]] * 8,
                               "prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_prompt_logprobs_are_bounded_by_prompt_tokens_times_k(
        path: str, body: dict[str, Any], param: str) -> None:
    """~170k prompt tokens x 20 built millions of entries on the replica's event loop."""
    judged = judge(json.dumps(body).encode(), HTTPEdge(), routes.EXACT[path])
    assert judged.problem is not None and judged.problem[0] == param, judged.problem
    assert "http.max_prompt_logprobs=262144" in judged.problem[1]
    assert "Fix" in judged.problem[1]


def test_small_prompt_logprobs_pass() -> None:
    body = {"prompt": "x" * 10_000, "prompt_logprobs": 20, "echo": True, "logprobs": 20}
    route = routes.EXACT[routes.COMPLETIONS_ROUTE]
    assert judge(json.dumps(body).encode(), HTTPEdge(), route).problem is None
    assert judge(json.dumps({**body, "prompt": [1] * 12_000}).encode(), HTTPEdge(),
                 route).problem is None
