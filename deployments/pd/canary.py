"""The P/D output canary's rules: its prompt, its tolerance, and its verdict (pure).

Equal specs do not prove equal pages: vLLM's NIXL connector can register a region with
the wrong length on both sides (vllm#57661), answer 200 after a failed receive
(vllm#52276) or decode with another request's transfer params (vllm#52234). So a pair
is also judged by its output. The decode replica (``deployments.pd.canary_run``)
sends a greedy request with a fresh ``cache_salt`` through the pair -- prompt
prefilled by the prefill replica, pages pulled over the connector, tokens decoded by
the decode engine -- then scores prompt + those tokens on its own engine alone
(prompt logprobs, which vLLM computes without reading the prefix cache). A page that
did not arrive, arrived short or belongs to another prompt moves the decoded tokens'
logprobs; the same pages computed locally do not, beyond rounding.

Each canary draws its prompt from its own seed: a pair replaying the transfer params of
an earlier canary decodes on the earlier prompt's pages, which a fixed prompt would
not show. The prompt is several KV blocks long and not a multiple of 128, so it crosses
the C4 and C128 compressed caches' boundaries and ends inside a block.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence

from deployments.control.canary_wire import CanaryMode

# Largest per-token |logprob through the pair - logprob scored alone| that passes, in
# nats, per platform. CPU: the decode engine recomputes the last prompt token and
# decodes step by step while the scoring pass is one prefill; the suite bounds that at
# ~1 bf16 ulp (0.016 nats) on AVX2 and at 0.45 nats where a ulp meets a MoE top-k near
# tie (AMX hosts; tests/test_dsv4_patch/test_engine_generation.py). Clean canaries here
# (scaled dummy weights, over 200 each on AVX2 and AVX-512 in
# benchmarks/results/pd_canary.json) reached 0.56 nats on one token, so 1.0; the faults'
# differences are in the same record. GPU: upstream's P/D consistency test allows 1.5
# (vLLM tests/v1/kv_connector/nixl_integration/test_hybrid_pd_consistency.py).
TOLERANCE = {"cpu": 1.0, "cuda": 1.5, "rocm": 1.5}
DEFAULT_TOLERANCE = 1.5
# Largest median per-token difference that passes. A near tie moves one or two decoded
# tokens; pages that are short or another prompt's move most of them. CPU (AVX2 and
# AVX-512, 700-token canaries, scaled dummy weights; benchmarks/results/pd_canary.json):
# clean medians stayed at 1 bf16 ulp (0.016 nats) over 200 canaries each while the
# largest single token reached 0.56; a row truncated to its named layer's page had
# medians 0.39-0.73 with a largest token under the 1.0 above (0.96: it passed the max
# rule). GPU: not measured here, so no default; ``pd.canary.median_tolerance`` sets one
# from a fleet's clean canaries.
MEDIAN_TOLERANCE = {"cpu": 0.1}
# The decode engine recomputes at most the last, partial block of the prompt itself.
RECOMPUTE_SLACK_TOKENS = 256
# Token ids below this are left out of canary prompts (special and control tokens).
FIRST_ID = 16
SCALED_WEIGHTS_ENV = "DSV4_TEST_SCALED_DUMMY_WEIGHTS"


def tolerance(platform: str, configured: float | None) -> float:
    """The configured tolerance, else the platform's measured one."""
    if configured is not None:
        return configured
    return TOLERANCE.get(platform, DEFAULT_TOLERANCE)


def median_tolerance(platform: str, configured: float | None) -> float | None:
    """The configured median bound, else the platform's measured one (None: not judged)."""
    return configured if configured is not None else MEDIAN_TOLERANCE.get(platform)


def prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    """The canary prompt of ``seed``: ``length`` token ids, no special ones."""
    if vocab_size <= FIRST_ID + 1:
        raise ValueError(f"vocab_size={vocab_size}: too small for a canary prompt "
                         f"(ids from {FIRST_ID}). Fix: check the model's config.json.")
    rng = random.Random(seed)  # noqa: S311  # a seeded, reproducible canary prompt, no secret
    return [rng.randrange(FIRST_ID, vocab_size) for _ in range(length)]


def prompt_length(requested: int, max_model_len: int, max_tokens: int) -> int:
    """The requested length, kept off 128-multiples and inside the context window."""
    length = min(requested, max_model_len - max_tokens - 1)
    if length % 128 == 0:
        length -= 1
    return length


def mode(load_format: str | None, env: dict[str, str]) -> tuple[CanaryMode, str]:
    """What the canary can prove on these weights, and why.

    vLLM's stock dummy weights (U(-1e-3, 1e-3)) make DeepSeek-V4 unigram: every output
    depends on the current token only, so wrong pages do not move it and a logprob
    comparison would pass vacuously. Then only the transfer is checked (the prompt
    arrived over the connector, the receive did not fail), and the result says so.
    Scaled dummy weights (the suite's engine-site hook ``SCALED_WEIGHTS_ENV``) and real
    weights depend on the context.
    """
    if (load_format or "auto") != "dummy" or env.get(SCALED_WEIGHTS_ENV) == "1":
        return CanaryMode.OUTPUT, ""
    return CanaryMode.TRANSFER_ONLY, (
        "load_format=dummy: vLLM's dummy weights make the model's output independent of "
        "the context, so wrong KV pages cannot show in it; the canary checks only that the "
        "prompt arrived over the connector and the receive did not fail")


# A logprob that is NaN or infinite (pages of garbage, e.g. another request's freed
# blocks) is recorded as this difference: it fails every tolerance and stays valid JSON.
NOT_FINITE = 1e9


def deltas(through_pair: Sequence[float], alone: Sequence[float]) -> list[float]:
    """Per decoded token: |its logprob through the pair - its logprob scored alone|
    (``NOT_FINITE`` where either is NaN or infinite: NaN compares false with any
    tolerance, so it must never reach a comparison)."""
    out = []
    for a, b in zip(through_pair, alone, strict=True):
        d = abs(a - b)
        out.append(d if math.isfinite(d) else NOT_FINITE)
    return out


# Logprobs the local reference keeps per decoded token: enough to find the pair's token
# where a near tie made the two greedy runs pick differently.
REFERENCE_TOP = 5


def match_reference(tokens: Sequence[int], through_pair: Sequence[float],
                    reference: Sequence[dict[int, float]]) -> list[float] | None:
    """Per decoded token |logprob through the pair - the local reference's|, or None
    when the local run cannot score every token (then score prompt + tokens alone).

    The reference is the same greedy request prefilled and decoded on the decode replica
    alone (``reference[i]``: token id -> logprob of its top tokens at step i). While the
    two runs pick the same tokens their contexts are equal and the logprobs compare
    directly; past the first different pick they are not.
    """
    if len(reference) < len(tokens):
        return None
    out = []
    for i, (token, lp) in enumerate(zip(tokens, through_pair, strict=True)):
        ref = reference[i].get(token)
        if ref is None:
            return None
        out.extend(deltas([lp], [ref]))
        if i + 1 < len(tokens) and max(reference[i], key=reference[i].__getitem__) != token:
            return None  # the runs diverge here: later tokens have other contexts
    return out


def judge(*, canary_mode: CanaryMode, prompt_tokens: int, max_tokens: int,
          tokens: Sequence[int], token_deltas: Sequence[float], tolerance_nats: float,
          external_tokens: int | None, finish_reason: str | None,
          median_tolerance_nats: float | None = None) -> str:
    """Why the canary failed ("" when it passed): the receive, the arrival, the output."""
    if finish_reason in ("error", "abort"):
        return (f"the decode request through the pair finished with {finish_reason!r} "
                "(a failed KV receive under kv_load_failure_policy=fail)")
    if len(tokens) != max_tokens:
        return f"the pair decoded {len(tokens)} of {max_tokens} tokens ({finish_reason})"
    if external_tokens is None or external_tokens < prompt_tokens - RECOMPUTE_SLACK_TOKENS:
        return (f"only {external_tokens} of {prompt_tokens} prompt tokens arrived over the "
                "connector: the decode engine computed the prompt itself, so the pair's "
                "transfer was not tested")
    if canary_mode is CanaryMode.OUTPUT:
        if any(not math.isfinite(d) or d >= NOT_FINITE for d in token_deltas):
            return ("a decoded token's logprob is NaN or infinite through the pair or "
                    "alone: the KV pages it decoded on are not the prompt's")
        worst = max(token_deltas, default=0.0)
        if worst > tolerance_nats:
            at = list(token_deltas).index(worst)
            return (f"decoded token {at} ({tokens[at]}) has logprob off by {worst:.3f} nats "
                    f"from the decode replica's own scoring (tolerance {tolerance_nats:g}): "
                    "the KV pages it decoded on differ from the prompt's")
        middle = statistics.median(token_deltas) if token_deltas else 0.0
        if median_tolerance_nats is not None and middle > median_tolerance_nats:
            return (f"the median decoded token's logprob is off by {middle:.3f} nats from the "
                    f"decode replica's own scoring (median tolerance "
                    f"{median_tolerance_nats:g}; largest {worst:.3f}): most tokens moved, "
                    "as when the KV pages are short or another prompt's")
    return ""
