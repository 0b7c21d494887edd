"""The routes a serving replica answers, the fields each bounds, and the ones kept closed.

vLLM 0.32's OpenAI app (``vllm.entrypoints.launchers.app.build_app``) mounts about 35
routes for a generative model. The edge (``deployments.http.edge``) lets a request
through only if its route is in ``SERVED``; everything else answers 404 before the
body is read, and a route in ``CLOSED`` says why it is closed. Each served route
names the request fields the edge bounds, judged as vLLM's pydantic models will
read them (lax mode: ``"256"`` and ``256.0`` are 256).

This module is data plus lookups: no I/O, no Ray, no vLLM import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Route paths other modules answer or call: owned here.
KV_SPEC_ROUTE = "/v1/kv-spec"
CHAT_ROUTE = "/v1/chat/completions"
CHAT_BATCH_ROUTE = "/v1/chat/completions/batch"
COMPLETIONS_ROUTE = "/v1/completions"
RESPONSES_ROUTE = "/v1/responses"
MESSAGES_ROUTE = "/v1/messages"
HEALTH_ROUTE = "/health"

# The limit (an ``HTTPEdge`` attribute) each kind of count is held to.
TOKENS, CHOICES, LOGPROBS = "max_tokens", "max_n", "max_logprobs"


@dataclass(frozen=True)
class Route:
    """One served route.

    ``bounds`` maps a top-level request field to the ``HTTPEdge`` limit it may not
    exceed; ``prompts`` names the field whose list length counts prompts (batched
    requests), held to ``http.max_prompts``. ``body``: POST routes read, judge and
    replay the body and hold an in-flight slot while they run; GET routes do neither.
    """

    path: str
    method: str
    bounds: dict[str, str] = field(default_factory=dict)
    prompts: str | None = None
    chat_messages: bool = False  # ``messages`` must be a list (else vLLM answers 500)
    stateful: bool = False  # Responses: store/background/previous_response_id rules
    # A GET that costs (a controller call, a held stream): it takes an in-flight slot.
    costly_get: bool = False
    # The field vLLM takes as the prompt logprobs' k when ``echo`` is true and
    # ``prompt_logprobs`` is unset (``to_sampling_params``); None: no prompt logprobs.
    echo_logprobs: str | None = None

    @property
    def body(self) -> bool:
        return self.method == "POST"

    @property
    def admitted(self) -> bool:
        """Whether a request on this route takes an in-flight slot while it runs."""
        return self.body or self.costly_get


# A dotted name is a nested field (``repetition_detection.max_pattern_size``): judged
# where vLLM reads it. ``deployments.http.fields`` classifies every other field.
_REPETITION = {"repetition_detection.max_pattern_size": TOKENS,
               "repetition_detection.min_pattern_size": TOKENS,
               "repetition_detection.min_count": TOKENS}
_CHAT_BOUNDS = {"n": CHOICES, "max_tokens": TOKENS, "max_completion_tokens": TOKENS,
                "min_tokens": TOKENS, "thinking_token_budget": TOKENS,
                "top_logprobs": LOGPROBS, "prompt_logprobs": LOGPROBS, **_REPETITION}

_ROUTES = (
    Route(CHAT_ROUTE, "POST", _CHAT_BOUNDS, chat_messages=True, echo_logprobs="top_logprobs"),
    # ``messages`` is a list of conversations: one generation each.
    Route(CHAT_BATCH_ROUTE, "POST", {**_CHAT_BOUNDS, "best_of": CHOICES}, prompts="messages",
          echo_logprobs="top_logprobs"),
    Route(COMPLETIONS_ROUTE, "POST",
          {"n": CHOICES, "best_of": CHOICES, "max_tokens": TOKENS, "min_tokens": TOKENS,
           "thinking_token_budget": TOKENS, "logprobs": LOGPROBS,
           "prompt_logprobs": LOGPROBS, **_REPETITION}, prompts="prompt",
          echo_logprobs="logprobs"),
    # thinking_token_budget: vLLM 0.34+.
    Route(RESPONSES_ROUTE, "POST", {"max_output_tokens": TOKENS, "top_logprobs": LOGPROBS,
                                    "thinking_token_budget": TOKENS}, stateful=True),
    # min_tokens: vLLM 0.34+; thinking.budget_tokens: below max_tokens (vLLM checks).
    Route(MESSAGES_ROUTE, "POST", {"max_tokens": TOKENS, "min_tokens": TOKENS,
                                   "thinking.budget_tokens": TOKENS}),
    Route(MESSAGES_ROUTE + "/count_tokens", "POST"),
    Route("/tokenize", "POST"),
    Route("/detokenize", "POST"),
    Route("/v1/models", "GET"),
    Route(KV_SPEC_ROUTE, "GET", costly_get=True),  # a controller call per request
    Route("/version", "GET"),
    Route(HEALTH_ROUTE, "GET"),
)
EXACT: dict[str, Route] = {r.path: r for r in _ROUTES}

# Routes with an id in the path: (pattern, route).
# ``?stream=true`` replays a stored stream: held like a generation.
RESPONSE_GET = Route(RESPONSES_ROUTE + "/{response_id}", "GET", stateful=True,
                     costly_get=True)
RESPONSE_CANCEL = Route(RESPONSES_ROUTE + "/{response_id}/cancel", "POST", stateful=True)
MODEL_GET = Route("/v1/models/{model}", "GET")
_PATTERNS = (
    (re.compile(r"^/v1/responses/([^/]+)/cancel$"), RESPONSE_CANCEL),
    (re.compile(r"^/v1/responses/([^/]+)$"), RESPONSE_GET),
    (re.compile(r"^/v1/models/.+$"), MODEL_GET),
)

SERVED = sorted([*EXACT, RESPONSE_GET.path, RESPONSE_CANCEL.path, MODEL_GET.path])

# Routes vLLM mounts (or OpenAI clients call) that stay closed, each with the reason its
# 404 gives. docs/serving.md lists them.
_METRICS_WHY = ("through Serve's proxy it would be one random replica's answer; scrape "
                "each node's Ray metrics export instead (vllm:* series tagged ReplicaId, "
                "docs/serving.md)")
_DEV_WHY = "a vLLM operator/developer control, never exposed to API clients"
_SPLIT_WHY = ("vLLM's disaggregated-serving internals (token-in/token-out, render): "
              "dsv4-serve runs P/D itself")
CLOSED: dict[str, str] = {
    "/metrics": _METRICS_WHY,
    "/load": "a load figure for vLLM's own router; Serve routes here",
    "/ping": "SageMaker's health route: use /health",
    "/invocations": "SageMaker's generic route: call the OpenAI route itself",
    "/generative_scoring": "not part of the OpenAI/Anthropic surface this server bounds",
    "/v1/systemone": ("vLLM's structured-decisions API: not part of the OpenAI/Anthropic "
                      "surface this server bounds"),
    "/kv_event_sources": "vLLM's KV-event plumbing for its own router",
    "/docs": "interactive docs are off on a serving endpoint",
    "/redoc": "interactive docs are off on a serving endpoint",
    "/openapi.json": "interactive docs are off on a serving endpoint",
    "/scale_elastic_ep": _DEV_WHY,
    "/is_scaling_elastic_ep": _DEV_WHY,
    "/collective_rpc": _DEV_WHY,
    "/sleep": _DEV_WHY,
    "/wake_up": _DEV_WHY,
    "/server_info": _DEV_WHY,
    "/start_profile": _DEV_WHY,
    "/stop_profile": _DEV_WHY,
    "/abort_requests": _DEV_WHY,
    "/v1/load_lora_adapter": _DEV_WHY,
    "/v1/unload_lora_adapter": _DEV_WHY,
    "/inference/v1/generate": _SPLIT_WHY,
    "/inference/v1/abort_requests": _SPLIT_WHY,
    "/v1/chat/completions/render": _SPLIT_WHY,
    "/v1/completions/render": _SPLIT_WHY,
    "/v1/messages/render": _SPLIT_WHY,
    "/v1/responses/render": _SPLIT_WHY,
    "/v1/chat/completions/derender": _SPLIT_WHY,
    "/v1/completions/derender": _SPLIT_WHY,
    "/v1/embeddings": "DeepSeek-V4 is a generative model: no pooling routes",
    "/pooling": "DeepSeek-V4 is a generative model: no pooling routes",
    "/classify": "DeepSeek-V4 is a generative model: no pooling routes",
    "/v1/score": "DeepSeek-V4 is a generative model: no pooling routes",
    "/v1/rerank": "DeepSeek-V4 is a generative model: no pooling routes",
    "/v1/audio/transcriptions": "DeepSeek-V4 takes no audio",
    "/v1/audio/translations": "DeepSeek-V4 takes no audio",
    # vLLM 0.34: mounted without --api-key checks of their own.
    "/checkpoint/prepare": _DEV_WHY,
    "/checkpoint/restore": _DEV_WHY,
    "/checkpoint/status": _DEV_WHY,
    "/v1/fault_tolerance/apply": _DEV_WHY,
    "/v1/fault_tolerance/status": _DEV_WHY,
    "/fault_tolerance/apply": _DEV_WHY,
    "/fault_tolerance/status": _DEV_WHY,
}


def find(path: str) -> Route | None:
    """The served route ``path`` belongs to, or None."""
    route = EXACT.get(path)
    if route is not None:
        return route
    for pattern, templated in _PATTERNS:
        if pattern.match(path):
            return templated
    return None


def response_id(path: str) -> str | None:
    """The id in ``/v1/responses/{id}[/cancel]``, else None."""
    for pattern, _ in _PATTERNS[:2]:
        match = pattern.match(path)
        if match:
            return match.group(1)
    return None
