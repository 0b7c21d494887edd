"""``args.dsv4.routing``: session affinity on the doors that can see a session key.

A conversation's turns share a growing prefix; sent to the replica that served the last
turn, its prefix is in that replica's KV cache (vLLM's prefix caching; DeepSeek-V4 hits
in 256-token steps). The key is the ``x-session-id`` header (Serve's session header,
``RAY_SERVE_SESSION_ID_HEADER_KEY``), the only per-conversation key Serve's proxy and
HAProxy see before a replica is picked: clients that use OpenAI's ``prompt_cache_key`` or
a Responses ``previous_response_id`` chain send the same value (the chain's first id)
as ``x-session-id``. No header: today's routing (power of two among the undrained).

The load guard, from Dynamo's KV router (overlap weighed against load) and llm-d's
scorers (prefix score plus queue and KV-usage scorers): the preferred replica is
skipped for power of two when its KV is nearly full (``kv_full``: it would evict the
prefix it is chosen for, or queue) or when it holds more than ``busier_ratio`` times
the least-loaded undrained replica's requests plus ``busier_slack``.
"""

from __future__ import annotations

from pydantic import Field

from deployments.config.base import _Strict


class RoutingSection(_Strict):
    """Session affinity in Serve's router (``serving.router``) and HAProxy."""

    affinity: bool = Field(default=True, description="send requests with the same "
                           "x-session-id to the same undrained replica (load allowing)")
    kv_full: float = Field(default=0.95, gt=0, le=1, description="skip the preferred "
                           "replica when its KV usage is at least this")
    busier_ratio: float = Field(default=2.0, ge=1, description="skip it when it holds more "
                                "than this times the least-loaded replica's requests ...")
    busier_slack: float = Field(default=4.0, ge=0, description="... plus this many")

    def router_kwargs(self) -> dict[str, float | bool]:
        """What Serve's router is initialised with (``request_router_kwargs``)."""
        return self.model_dump()
