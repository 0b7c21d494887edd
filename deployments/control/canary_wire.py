"""The P/D output canary's messages: controller -> decode replica -> controller -> report.

A canary checks one (prefill, decode) pair by its output (``deployments.pd.canary``); the
controller asks the decode replica to run it (``CanaryRequest``), the replica answers a
``CanaryResult``, and the latest result per pair is published in ``GET /v1/kv-spec``
(``PDReport.canaries``) and ``dsv4-serve status``.
"""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from deployments.control.replica_wire import SCHEMA_VERSION, _Wire


class CanaryMode(str, Enum):
    """What a canary can prove on this deployment's weights."""

    OUTPUT = "output"  # logprobs compared: the outputs depend on the context
    TRANSFER_ONLY = "transfer_only"  # stock dummy weights: arrival and receive only


class CanaryRequest(_Wire):
    """controller -> decode replica: run one canary through ``prefill_replica``."""

    schema_version: int = SCHEMA_VERSION
    prefill_replica: str
    seed: int = Field(description="draws the prompt: each canary's differs, so replayed "
                      "transfer params of an earlier canary show")
    prompt_tokens: int
    max_tokens: int
    tolerance: float | None = None
    median_tolerance: float | None = None
    timeout_s: float = 120.0


class CanaryResult(_Wire):
    """decode replica -> controller: one canary's verdict with its evidence."""

    schema_version: int = SCHEMA_VERSION
    prefill_replica: str
    decode_replica: str
    passed: bool
    mode: CanaryMode
    reason: str = Field(default="", description="why it failed, or why only the transfer "
                        "was checked")
    seed: int
    prompt_tokens: int
    tokens: list[int] = Field(default_factory=list, description="tokens the pair decoded")
    deltas: list[float] = Field(default_factory=list, description="per token |logprob through "
                                "the pair - logprob scored on the decode replica alone|")
    max_delta: float | None = None
    tolerance: float
    median_delta: float | None = None
    median_tolerance: float | None = Field(default=None, description="the bound on "
                                           "median_delta (None: not judged)")
    external_tokens: int | None = Field(default=None, description="prompt tokens the decode "
                                        "engine took from the connector (vLLM's "
                                        "num_cached_tokens; prefix cache salted away)")
    finish_reason: str | None = None
    kv_load_failure_policy: str | None = None
    failed_kv_transfers: int | None = Field(default=None, description="set when the result "
                                            "comes from the decode replica's failure "
                                            "counter, not a canary: the failed KV transfers "
                                            "it counted since the previous check")
    seconds: float = 0.0
    phase_s: dict[str, float] = Field(default_factory=dict, description="seconds per phase: "
                                      "prefill (on the prefill replica), decode (pages "
                                      "pulled, tokens decoded), score (alone)")
    at: float = 0.0

    @property
    def pair(self) -> tuple[str, str]:
        return self.decode_replica, self.prefill_replica


class CanaryBatch(_Wire):
    """controller -> every decode replica (broadcast): each runs the requests under its id."""

    schema_version: int = SCHEMA_VERSION
    requests: dict[str, list[CanaryRequest]] = Field(default_factory=dict)
