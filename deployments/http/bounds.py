"""What the edge judges in a request body, before vLLM reads it: pure functions.

Each check runs in time linear in the body (``json_depth`` is one regex pass and one
scan; the rest walk the parsed body once) and judges a field as vLLM's pydantic
request models will read it (``engine_int``). ``deployments.http.parsed.judge`` is the
whole judgement for one route (``deployments.http.routes``): bytes first
(``bytes_problem``), then the parsed body with vLLM's coerced values (``parsed_problem``).
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

from pydantic import TypeAdapter, ValidationError

from deployments.config import HTTPEdge
from deployments.http import routes
from deployments.http.errors import messages_problem

# A JSON string, or an unterminated one running to the end of the body (a trailing lone
# backslash included). Every match attempt that starts at a quote succeeds and consumes
# through its end, so ``sub`` never rescans: linear in the body, whatever it holds. (The
# old pattern without the end alternatives restarted at every escaped quote of an
# unterminated string and rescanned to the end: quadratic, ~50 min on 1 MiB.)
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*(?:"|\\?\Z)', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_INT = TypeAdapter(int)  # lax, like vLLM's request models: "256", 256.0 and True are ints
# Set only by dsv4-serve's own P/D path (through a handle, never HTTP): vLLM's NIXL
# connector reads remote_host/remote_port/remote_block_ids from them.
FORBIDDEN_FIELDS = ("kv_transfer_params", "ec_transfer_params")
UTF8 = ("utf-8", "utf-8-sig")


def json_depth(raw: bytes) -> int:
    """Nesting depth of a JSON text, without parsing it (strings skipped).

    Linear and iterative, so it is safe to run on a hostile body before
    ``json.loads``/pydantic/pickle, which all recurse.
    """
    skeleton = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(_STEP[b] for b in skeleton), default=0)


def engine_int(value: Any) -> int | None:
    """``value`` as vLLM's request models will read an ``int`` field, or None when they
    will refuse it (their 400 then names the type). Same library, same lax rules."""
    if value is None or isinstance(value, (dict, list)):
        return None
    try:
        return _INT.validate_python(value)
    except ValidationError:
        return None


def _prompt_count(prompt: Any) -> int:
    """Prompts in a batch field: a list of strings, token-id lists or conversations."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def _limit(limits: HTTPEdge, name: str) -> int:
    return int(getattr(limits, name))


def field_at(body: dict[str, Any], path: str) -> Any:
    """The value at a dotted field path (``thinking.budget_tokens``), else None."""
    value: Any = body
    for part in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def limit_problem(body: Any, limits: HTTPEdge,
                  route: routes.Route = routes.EXACT[routes.COMPLETIONS_ROUTE],
                  ) -> tuple[str, str] | None:
    """(param, message) for the first bound a parsed body exceeds, else None.

    Each field is judged as the engine will read it (``engine_int``), at the depth
    vLLM reads it (dotted names); a value the request schema will refuse is left to
    that schema's 400.
    """
    if not isinstance(body, dict):
        return None
    for name, limit_name in route.bounds.items():
        value, limit = engine_int(field_at(body, name)), _limit(limits, limit_name)
        if value is not None and value > limit:
            return name, (f"{name}={value} is above this server's limit http.{limit_name}="
                          f"{limit}. Fix: ask for at most {limit}.")
    if route.prompts is not None:
        prompts = _prompt_count(body.get(route.prompts))
        if prompts > limits.max_prompts:
            return route.prompts, (
                f"{route.prompts} holds {prompts} prompts, above this server's limit "
                f"http.max_prompts={limits.max_prompts}. Fix: split the batch.")
    return None


# The chat template's own text around the messages (role markers, a system preamble),
# in tokens: added to a chat prompt's byte count, an upper bound of its tokens.
TEMPLATE_TOKENS = 1024


def prompt_tokens_at_most(body: dict[str, Any], route: routes.Route) -> int:
    """An upper bound of the prompt tokens vLLM will score, linear in the body: a token
    is at least one UTF-8 byte of text; a token-id list counts its ids; a chat prompt
    is its messages' JSON (more bytes than their text) plus the template's tokens."""
    if route.prompts == "prompt":  # completions: text, token ids, or lists of either
        stack, total = [body.get("prompt")], 0
        while stack:
            value = stack.pop()
            if isinstance(value, str):
                total += len(value.encode("utf-8", "surrogatepass"))
            elif isinstance(value, list):
                ids = sum(1 for v in value if isinstance(v, int))
                total += ids
                stack.extend(v for v in value if not isinstance(v, int))
        return total
    conversations = body.get("messages")
    count = len(conversations) if route.prompts == "messages" and \
        isinstance(conversations, list) else 1
    text = json.dumps(conversations, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return len(text) + TEMPLATE_TOKENS * max(1, count)


def prompt_logprobs_problem(body: dict[str, Any], limits: HTTPEdge,
                            route: routes.Route) -> tuple[str, str] | None:
    """(param, message) when the prompt logprobs asked for (``prompt_logprobs``, else
    ``echo`` with the route's logprobs field, as vLLM's ``to_sampling_params`` reads
    them) would build more than ``http.max_prompt_logprobs`` entries."""
    if route.echo_logprobs is None:
        return None
    param, k = "prompt_logprobs", engine_int(body.get("prompt_logprobs"))
    if k is None and body.get("echo") is True:
        param, k = "echo", engine_int(body.get(route.echo_logprobs))
    if k is None or k < 0:  # -1 (the vocabulary) is refused by http.max_logprobs/vLLM
        return None
    tokens = prompt_tokens_at_most(body, route)
    entries, budget = tokens * (k + 1), limits.max_prompt_logprobs
    if entries <= budget:
        return None
    return param, (f"prompt logprobs with k={k} over a prompt of up to {tokens} tokens "
                   f"(counted as its UTF-8 bytes, an upper bound) are up to {entries} "
                   f"entries, above this server's limit http.max_prompt_logprobs={budget}. "
                   f"Fix: ask for a smaller k, or score at most {budget // (k + 1)} bytes "
                   "of prompt per request.")


def forbidden_path(body: Any) -> str | None:
    """The path of the first key only the server may set, at any depth, else None.

    Iterative and linear in the parsed body: vLLM copies free-form carriers
    (``vllm_xargs`` into ``SamplingParams.extra_args``) to where the KV connector
    reads ``kv_transfer_params``, so a nested one is as dangerous as a top-level one
    (a falsy or non-dict value there killed the P/D decode engine).
    """
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                path = f"{where}.{key}" if where else str(key)
                if key in FORBIDDEN_FIELDS:
                    return path
                stack.append((path, item))
        elif isinstance(value, list):
            stack.extend((f"{where}.{i}", item) for i, item in enumerate(value))
    return None


def forbidden_problem(body: Any) -> tuple[str, str] | None:
    """(param, message) when a client sets a field only dsv4-serve's P/D path may set."""
    path = forbidden_path(body)
    if path is None:
        return None
    name = path.rsplit(".", 1)[-1]
    return path, (f"{path}: {name} is set by the server's own prefill/decode path, never "
                  "by a client (it names hosts and KV blocks to pull), at any depth. Fix: "
                  f"remove {name} from the request.")


STORE_SETTING = "http.responses_store"


def state_problem(body: Any, store: bool) -> tuple[str, str] | None:
    """(param, message) for a Responses request that needs the response store when it is
    off: vLLM would drop ``store`` silently and answer ``previous_response_id`` 404."""
    if store or not isinstance(body, dict):
        return None
    for name, wants in (("store", body.get("store") is True),
                        ("background", body.get("background") is True),
                        ("previous_response_id", body.get("previous_response_id") is not None)):
        if wants:
            return name, (f"{name} needs stored responses, and this server does not store "
                          f"them ({STORE_SETTING} is false). Fix: omit {name} and send the "
                          "whole conversation as input, or ask the operator to enable "
                          f"{STORE_SETTING}.")
    return None


def encoding_problem(raw: bytes) -> str | None:
    """JSON between systems is UTF-8 (RFC 8259 section 8.1). ``json.loads`` also takes
    UTF-16/32, where the byte-level depth count is off: such a body that reads as a JSON
    object or array is refused; bytes that are no JSON text in any encoding are left to
    the request schema's 400."""
    if not raw:
        return None
    encoding = json.detect_encoding(raw)
    if encoding in UTF8:
        return None
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError:
        return None
    if not text.lstrip("\ufeff \t\r\n").startswith(("{", "[")):
        return None
    return (f"the body is {encoding}-encoded JSON; this server takes UTF-8 only. Fix: send "
            "the body as UTF-8.")


def bytes_problem(raw: bytes, settings: HTTPEdge) -> str | None:
    """The message for a body refused on its bytes (encoding, nesting: both linear)."""
    encoding = encoding_problem(raw)
    if encoding:
        return encoding
    depth = json_depth(raw)
    if depth > settings.max_json_depth:
        return (f"the body nests {depth} levels deep, above this server's limit "
                f"http.max_json_depth={settings.max_json_depth}. Fix: flatten the "
                "request.")
    return None


def parsed_problem(body: Any, settings: HTTPEdge,
                   route: routes.Route) -> tuple[str | None, str] | None:
    """(param, message) for the first thing wrong with a parsed body whose judged fields
    hold vLLM's coerced values (``deployments.http.parsed``).

    Order: fields only the server may set, the route's bounds, chat ``messages``, the
    Responses store rules.
    """
    problem = forbidden_problem(body) or limit_problem(body, settings, route)
    if problem is None and isinstance(body, dict):
        problem = prompt_logprobs_problem(body, settings, route)
    if problem is None and route.stateful:
        problem = state_problem(body, settings.responses_store)
    if problem:
        return problem
    bad_messages = messages_problem(body) if route.chat_messages else None
    if bad_messages:
        return "messages", "Invalid request: " + bad_messages
    return None
