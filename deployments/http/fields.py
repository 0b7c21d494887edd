"""Every field vLLM reads from a request, decided: bounded, refused, gated on the store, or free.

A field path is dotted (``thinking.budget_tokens``: ``budget_tokens`` inside the
``thinking`` object). ``decide(route, path)`` says what the edge does with it:

* **bounded**: ``routes.Route.bounds`` holds it to an ``http.*`` limit, judged as
  vLLM's pydantic lax mode coerces it (``bounds.engine_int``: ``"256"`` is 256), at
  the depth vLLM reads it; a prompt-list field is held to ``http.max_prompts``;
* **refused**: only dsv4-serve's own P/D path sets it (``bounds.FORBIDDEN_FIELDS``),
  refused at any depth, free-form carriers (``vllm_xargs``) included;
* **store**: Responses state, refused while ``http.responses_store`` is off;
* **free**: passed to vLLM; its cost is bounded by the body limits
  (``http.max_body_bytes``, ``http.max_json_depth``) and ``http.max_tokens``, or vLLM
  refuses it by default (the reason says which).

``tests/test_deployments/test_edge_fields.py`` walks every request model of every
supported vLLM release and fails naming any field ``decide`` leaves undecided. Pure
data: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from deployments.http import routes
from deployments.http.bounds import FORBIDDEN_FIELDS

Kind = Literal["bounded", "refused", "store", "free"]
STORE_FIELDS = ("store", "background", "previous_response_id")
# The type vLLM's ResponsesRequest declares for each store field (``Optional`` dropped):
# the edge judges the field after the same lax coercion (``deployments.http.parsed``).
STORE_TYPES = {"store": "bool", "background": "bool", "previous_response_id": "str"}

_SIZE = "bounded by http.max_body_bytes and http.max_json_depth"
_FLAG = "a switch or a choice among fixed values: costs nothing"
_SAMPLING = "a sampling parameter (float or seed): costs nothing per token more"
_OUTPUT = "what the answer includes: bounded by the tokens generated (http.max_tokens)"
_TEMPLATE = f"rendered by the chat template; {_SIZE}"
_GRAMMAR = f"compiled by the structured-output backend in the engine; {_SIZE}"
_OFF = "refused by vLLM unless its operator flag is on (dsv4-serve never sets it)"
_TEXT = "DeepSeek-V4 takes text only: vLLM refuses multimodal input for it"
_ID = "an identifier or label echoed back or used for caching"
_CARRIER = (f"a free-form carrier: {_SIZE}; server-only keys in it are refused at any "
            "depth (bounds.forbidden_path)")

# Field (or ``prefix.*``: it and everything below) -> why it is free.
FREE: dict[str, str] = {
    # prompts and conversations
    "messages.*": _TEMPLATE, "system.*": _TEMPLATE, "input": _TEMPLATE,
    "instructions": _TEMPLATE, "prompt": _SIZE, "suffix": _SIZE, "tokens": _SIZE,
    "previous_input_messages": _TEMPLATE, "documents": _TEMPLATE,
    "chat_template_kwargs": _TEMPLATE, "chat_template": _OFF + " (trust_request_chat_template)",
    "add_generation_prompt": _FLAG, "continue_final_message": _FLAG,
    "add_special_tokens": _FLAG, "truncate_prompt_tokens": "shortens the prompt",
    "truncation_side": _FLAG, "truncation": _FLAG,
    "prompt_embeds": _OFF + " (enable_prompt_embeds)",
    # tools and structured output
    "tools.*": _TEMPLATE, "tool_choice.*": _FLAG, "parallel_tool_calls": _FLAG,
    "max_tool_calls": "a cap the client sets on its own built-in tool calls",
    "response_format.*": _GRAMMAR, "structured_outputs.*": _GRAMMAR, "text": _GRAMMAR,
    "output_config.*": _GRAMMAR, "guided_decoding_backend": _FLAG,
    # sampling
    "temperature": _SAMPLING, "top_p": _SAMPLING, "top_k": _SAMPLING, "min_p": _SAMPLING,
    "seed": _SAMPLING, "frequency_penalty": _SAMPLING, "presence_penalty": _SAMPLING,
    "repetition_penalty": _SAMPLING, "length_penalty": _SAMPLING, "early_stopping": _FLAG,
    "use_beam_search": "beam width is n (bounded by http.max_n)",
    "stop": _SIZE, "stop_token_ids": _SIZE, "stop_sequences": _SIZE, "bad_words": _SIZE,
    "allowed_token_ids": _SIZE, "logit_bias": _SIZE, "ignore_eos": _OUTPUT,
    "watermarking": _SAMPLING, "reasoning_effort": _FLAG, "reasoning": _FLAG,
    "include_reasoning": _FLAG, "thinking": _FLAG, "thinking.type": _FLAG,
    "thinking.display": _FLAG,
    "thinking.budget_tokens": "count_tokens generates nothing (/v1/messages bounds it)",
    "repetition_detection": _FLAG, "priority": (
        "read only under vLLM's priority scheduling (dsv4-serve runs FCFS)"),
    # what the answer carries
    "echo": _OUTPUT + " (with logprobs: http.max_prompt_logprobs)",
    "logprobs": _OUTPUT + " (chat: a switch; completions: bounded)",
    "logprob_token_ids": _SIZE, "stream": _FLAG, "stream_options.*": _FLAG,
    "stream_interval": "chunks per stream: the stream limits hold it",
    "skip_special_tokens": _FLAG, "spaces_between_special_tokens": _FLAG,
    "include_stop_str_in_output": _FLAG, "include": _OUTPUT,
    "return_token_ids": _OUTPUT, "return_tokens_as_token_ids": _OUTPUT,
    "return_token_offsets": _OUTPUT, "return_token_strs": _OUTPUT,
    "return_prompt_text": _OUTPUT, "return_assistant_tokens_mask": _OUTPUT,
    "return_weight_versions": _OUTPUT, "return_mm_kwargs": _TEXT,
    "enable_response_messages": _OUTPUT, "routed_experts_prompt_start": _OUTPUT,
    # multimodal (text-only model)
    "mm_payload": _TEXT, "mm_processor_kwargs": _TEXT, "media_io_kwargs": _TEXT,
    # ids, labels, caching
    "model": _ID, "user": _ID, "request_id": _ID + " (Responses with the store on: "
    "assigned by the edge, a client's refused)", "session_id": _ID, "cache_salt": _ID,
    "metadata": _ID, "service_tier": _ID, "safety_identifier": _ID,
    "prompt_cache_key": _ID, "prompt_cache_retention": _ID, "prompt_cache_options.*": _ID,
    # carriers
    "vllm_xargs": _CARRIER,
}


@dataclass(frozen=True)
class Decision:
    """What the edge does with one field of one route's requests."""

    kind: Kind
    why: str
    limit: str | None = None  # the http.* limit of a bounded field
    coerced: str | None = None  # the type vLLM coerces it to, as the edge judges it


def _free(path: str) -> str | None:
    if path in FREE:
        return FREE[path]
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        why = FREE.get(".".join(parts[:cut]) + ".*")
        if why is not None:
            return why
    return None


def decide(route: routes.Route, path: str) -> Decision | None:
    """The decision for ``path`` on ``route``; None when nobody decided it."""
    if path in route.bounds:
        return Decision("bounded", f"at most http.{route.bounds[path]}",
                        route.bounds[path], "int")
    if path == "echo" and route.echo_logprobs is not None:
        return Decision("bounded", "with echo, the prompt logprobs count against "
                        "http.max_prompt_logprobs (prompt tokens x k)",
                        "max_prompt_logprobs", "bool")
    if path == route.prompts:
        return Decision("bounded", "its prompts count against http.max_prompts",
                        "max_prompts", "list length")
    if path.rsplit(".", 1)[-1] in FORBIDDEN_FIELDS:
        return Decision("refused", "set only by dsv4-serve's own P/D path, at any depth")
    if route.stateful and path in STORE_FIELDS:
        return Decision("store", "refused while http.responses_store is off",
                        coerced=STORE_TYPES[path])
    why = _free(path)
    return Decision("free", why) if why is not None else None


def judged(route: routes.Route) -> dict[str, str]:
    """Every field path of ``route`` the edge judges on a value, with the type vLLM's
    model coerces it to (``int``, ``bool``, ``str``): its bounds and store gates."""
    paths = [*route.bounds, *(STORE_FIELDS if route.stateful else ()),
             *(("echo",) if route.echo_logprobs is not None else ())]
    out = {}
    for path in paths:
        decision = decide(route, path)
        if decision is not None and decision.coerced in ("int", "bool", "str"):
            out[path] = decision.coerced
    return out

