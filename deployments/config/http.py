"""``args.http``: the HTTP edge's keys and bounds, and where API keys come from (never the YAML)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
)

from deployments.config.base import _Strict

# Where the HTTP edge reads API keys (deployments/http/auth.py); never from the YAML.
DEFAULT_API_KEYS_ENV = "DSV4_API_KEYS"
DEFAULT_API_KEYS_FILE_ENV = "DSV4_API_KEYS_FILE"
# Secrets that must never sit in runtime_env (the state API echoes runtime_env back).
SECRET_ENV_VARS = (DEFAULT_API_KEYS_ENV, "VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


# -------------------------------------------------------------------- http part


class AuthConfig(_Strict):
    """Who may call the API: the key *sources* (names and paths), never the keys."""

    mode: Literal["auto", "keys", "off"] = Field(
        default="auto", description="auto: keys required unless the proxy binds a loopback "
        "address; keys: always; off: never (explicit opt-out, no key may be configured)")
    keys_env: str = Field(default=DEFAULT_API_KEYS_ENV, min_length=1,
                          description="env var holding comma/space-separated keys")
    keys_file_env: str = Field(default=DEFAULT_API_KEYS_FILE_ENV, min_length=1,
                               description="env var holding the path of a key file")
    keys_file: str | None = Field(default=None, min_length=1,
                                  description="key file (one per line), e.g. a mounted Secret")

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        """YAML 1.1 reads an unquoted ``mode: off`` as ``false``: that is the word off."""
        if value is False:
            return "off"
        if value is True:
            raise ValueError("mode: true (YAML reads on/yes/true as a boolean): expected "
                             "auto, keys or off. Fix: write mode: keys.")
        return value


class ReplicaPortLimits(_Strict):
    """Waits and connections on each replica's own uvicorn (``http.replica_port``, or the
    replica's own port behind HAProxy): they come before any key is checked
    (``deployments.doors.guard``)."""

    header_timeout_s: float = Field(
        default=15.0, gt=0, le=300, description="a connection must send a request's full "
        "headers within this long of opening (or of the first byte after a response); "
        "else it is closed")
    idle_timeout_s: int = Field(
        default=90, ge=1, le=3600, description="a kept-alive connection with no request "
        "is closed after this long")
    max_connections: int = Field(
        default=1024, ge=1, le=1 << 16, description="connections one replica holds on the "
        "port at once (requests in flight plus idle keep-alives); the next one gets a 503 "
        "and is closed")


class HTTPEdge(_Strict):
    """The HTTP edge of the ingress: auth, CORS, body and request bounds, overload.

    Every bound answers a client error (4xx) or an overload (503 + Retry-After) that
    names the limit, so no client input can make the server answer 5xx or run away.
    """

    auth: AuthConfig = Field(default_factory=AuthConfig)
    cors_allow_origins: list[str] = Field(
        default_factory=list, description="origins browsers may call from; empty = CORS off")
    max_body_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20)
    max_json_depth: int = Field(default=32, ge=4, le=256)
    max_n: int = Field(default=4, ge=1, le=128)
    max_prompts: int = Field(default=16, ge=1, le=4096)
    max_tokens: int = Field(default=8192, ge=1, le=1 << 24)
    # Requests one ingress replica holds at once (running + waiting); above: 503.
    max_in_flight: int = Field(default=256, ge=1)
    # vLLM's own default ``max_logprobs``: the engine refuses more, the edge says so first.
    max_logprobs: int = Field(default=20, ge=0, le=1 << 20)
    # Prompt logprobs (``prompt_logprobs``, or ``echo`` with logprobs) are built per prompt
    # token on the replica's event loop: at most this many entries, prompt tokens x
    # (k + 1), the prompt's tokens bounded at the edge by its UTF-8 bytes (a token is at
    # least one byte; token-id prompts are counted exactly). 2**18: k=20 on ~12 KB of
    # prompt text, k=1 on ~128 KB, k=0 (each token's own logprob) on 256 KB.
    max_prompt_logprobs: int = Field(default=1 << 18, ge=1, le=1 << 30)
    # A body that has not fully arrived by then is refused (408): a slow upload must not
    # hold a connection or a slot.
    body_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    # vLLM's Responses store (VLLM_ENABLE_RESPONSES_API_STORE) is per process: stored
    # responses, background runs and previous_response_id live on one replica.
    responses_store: bool = False
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    stream_max_s: float = Field(default=1800.0, gt=0)
    stream_idle_s: float = Field(default=120.0, gt=0)
    # A refresh of /v1/kv-spec runs 2N RPCs: at most one per interval per ingress replica.
    kv_spec_refresh_interval_s: float = Field(default=1.0, ge=0, le=3600)
    # Each ingress replica answers HTTP itself on http_options.host:replica_port, a port
    # all replicas on the machine share (SO_REUSEPORT: the kernel spreads connections),
    # so a request crosses no proxy (deployments/doors/listener.py, docs/serving.md).
    # Serve's proxy keeps http_options.port as a second door to the same edge. For one
    # machine (the local run); None = Serve's proxy is the only door.
    replica_port: int | None = Field(default=None, ge=1, le=65535)
    replica_port_limits: ReplicaPortLimits = Field(default_factory=ReplicaPortLimits)
    # The door on http_options.port when Serve routes (autoscaled, multi-node, KubeRay):
    # "serve_proxy" = Serve's Python proxy; "haproxy" = Ray's HAProxy ingress forwarding
    # to each replica's own port on its app loop (docs/serving.md "Doors"). HAProxy is a
    # cluster-wide Ray setting (RAY_SERVE_ENABLE_HA_PROXY in every Ray process): `dsv4-serve
    # run` sets it for its own cluster, the KubeRay manifests in the pods' env, and
    # build_app refuses a config that says otherwise than the cluster it runs on.
    ingress: Literal["serve_proxy", "haproxy"] = "serve_proxy"

    @field_validator("cors_allow_origins")
    @classmethod
    def _no_wildcard(cls, origins: list[str]) -> list[str]:
        if "*" in origins:
            raise ValueError(
                "cors_allow_origins contains '*': any web page could then call the API "
                "with a visitor's browser. Fix: list the origins, e.g. "
                "[\"https://chat.example.com\"].")
        return origins
