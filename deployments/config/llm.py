"""``args.llm``: the parts of Ray Serve LLM's ``LLMConfig`` that decide the KV layout and
the replica shape.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from deployments.config.base import (
    DEFAULT_DRAIN_POLL_S,
    DEFAULT_DRAIN_TIMEOUT_S,
    PLUGIN_NAME,
    TINY_MODEL_SOURCE,
    WORKER_EXTENSION,
    _Open,
    _Strict,
)
from deployments.config.http import DEFAULT_API_KEYS_ENV, DEFAULT_API_KEYS_FILE_ENV, SECRET_ENV_VARS
from dsv4_patch import rules

# --------------------------------------------------------------------- llm part


class ModelLoading(_Strict):
    """Ray Serve LLM ``model_loading_config``: the served id and where weights live."""

    model_id: str = Field(min_length=1, description="name clients put in `model`")
    model_source: str | None = Field(
        default=None,
        description=f"HF repo id, local directory, or {TINY_MODEL_SOURCE!r} "
        "for the tiny random-weight DeepSeek-V4 (built on first use)",
    )
    tokenizer_source: str | None = None

    @property
    def is_tiny(self) -> bool:
        return self.model_source == TINY_MODEL_SOURCE


class EngineKwargs(_Open):
    """vLLM engine arguments; the typed ones shape the KV cache or the replica."""

    kv_cache_dtype: str = Field(
        default="auto", description="auto|fp8|fp8_e4m3|bfloat16|...; resolved per node"
    )
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    # > 1: Ray Serve LLM DP attention (one Serve replica per DP rank, gang of this size).
    data_parallel_size: int = Field(default=1, ge=1)
    enable_expert_parallel: bool = False
    block_size: int | None = Field(default=None, ge=1)
    attention_backend: str | None = None
    worker_extension_cls: str | None = None
    api_key: Any = Field(default=None, exclude=True)

    @field_validator("api_key")
    @classmethod
    def _no_key_in_yaml(cls, value: Any) -> None:
        """vLLM's ``--api-key`` is not honoured by Ray Serve LLM: refuse it, never ignore it.

        Ray Serve LLM 2.60 moves it into frontend kwargs its ingress never reads, so
        the server would run open while the config says it is protected; and a key
        in the YAML is a key in git, in ``serve status`` and in KubeRay manifests.
        """
        if value is not None:
            raise ValueError(
                "engine_kwargs.api_key is set: Ray Serve LLM's ingress ignores it and a "
                "key in the config leaks with the config. Fix: remove it and put the key "
                f"in the {DEFAULT_API_KEYS_ENV} environment variable (or a file named by "
                f"{DEFAULT_API_KEYS_FILE_ENV}); dsv4-serve checks it on every request.")
        return None

    @field_validator("kv_cache_dtype")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.strip().lower()

    @field_validator("worker_extension_cls")
    @classmethod
    def _ours_or_unset(cls, value: str | None) -> str | None:
        return ours_or_unset(value)


def ours_or_unset(worker_extension_cls: str | None) -> str | None:
    """The one check of ``engine_kwargs.worker_extension_cls`` (the config and a replica
    built from a bare ``LLMConfig``): unset or ours, else ValueError."""
    if worker_extension_cls not in (None, WORKER_EXTENSION):
        raise ValueError(
            f"worker_extension_cls={worker_extension_cls!r}: the KV-spec controller needs "
            f"{WORKER_EXTENSION!r} in every worker. Fix: remove the key "
            "(dsv4-serve sets it)."
        )
    return worker_extension_cls


class AutoscalingConfig(_Open):
    """Serve autoscaling bounds; ``initial_replicas`` must sit inside them."""

    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    initial_replicas: int | None = Field(default=None, ge=0)
    target_ongoing_requests: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas={self.min_replicas} > max_replicas={self.max_replicas}; "
                "expected min_replicas <= max_replicas. Fix: raise max_replicas or "
                "lower min_replicas."
            )
        init = self.initial_replicas
        if init is not None and not self.min_replicas <= init <= self.max_replicas:
            raise ValueError(
                f"initial_replicas={init} is outside [{self.min_replicas}, "
                f"{self.max_replicas}]. Fix: pick a value between min_replicas and max_replicas."
            )
        return self


class DeploymentConfig(_Open):
    """Ray Serve deployment options of the DSv4 server deployment."""

    num_replicas: int | None = Field(default=None, ge=1)
    autoscaling_config: AutoscalingConfig | None = None
    # None = ours (DEFAULT_DRAIN_*), filled in by llm_config_dict; typed so a bad value
    # fails validation before Ray starts.
    graceful_shutdown_timeout_s: float | None = Field(default=None, ge=0)
    graceful_shutdown_wait_loop_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_way_to_scale(self) -> DeploymentConfig:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError(
                f"num_replicas={self.num_replicas} and autoscaling_config are both set; "
                "Serve takes one. Fix: drop num_replicas and set "
                "autoscaling_config.min_replicas/max_replicas."
            )
        for key in ("placement_group_bundles", "placement_group_strategy"):
            if key in (self.model_extra or {}):
                raise ValueError(
                    f"deployment_config.{key} is set; Ray Serve LLM builds the placement "
                    "group itself. Fix: move it to llm.placement_group_config."
                )
        return self

    @property
    def drain_timeout_s(self) -> float:
        """How long a stopping server replica may take to finish in-flight requests."""
        if self.graceful_shutdown_timeout_s is None:
            return DEFAULT_DRAIN_TIMEOUT_S
        return self.graceful_shutdown_timeout_s

    @property
    def drain_poll_s(self) -> float:
        if self.graceful_shutdown_wait_loop_s is None:
            return DEFAULT_DRAIN_POLL_S
        return self.graceful_shutdown_wait_loop_s

    @property
    def max_replicas(self) -> int:
        if self.autoscaling_config is not None:
            return self.autoscaling_config.max_replicas
        return self.num_replicas or 1


class PlacementGroupConfig(_Strict):
    """The resources of one replica: one bundle per engine worker.

    "One replica per GPU node" is ``bundles`` of the node's GPUs (one
    ``{GPU: 1, CPU: n}`` per tensor/pipeline rank) with ``STRICT_PACK``: Ray then
    places the whole replica on one node, and the autoscaler adds nodes, not GPUs.
    """

    bundles: list[dict[str, float]] = Field(min_length=1)
    strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"

    @field_validator("bundles")
    @classmethod
    def _non_negative(cls, bundles: list[dict[str, float]]) -> list[dict[str, float]]:
        for i, bundle in enumerate(bundles):
            bad = {k: v for k, v in bundle.items() if v < 0}
            if bad or not bundle:
                raise ValueError(
                    f"bundles[{i}]={bundle!r}: expected a non-empty map of resource -> "
                    "amount >= 0, e.g. {GPU: 1, CPU: 4}."
                )
        return bundles

    def gpus(self) -> float:
        return sum(b.get("GPU", 0) for b in self.bundles)


class LLMSection(_Strict):
    """The ``LLMConfig`` of the DSv4 server deployment (Ray Serve LLM field names)."""

    model_loading_config: ModelLoading
    engine_kwargs: EngineKwargs = Field(default_factory=EngineKwargs)
    deployment_config: DeploymentConfig = Field(default_factory=DeploymentConfig)
    placement_group_config: PlacementGroupConfig | None = None
    accelerator_type: str | None = None
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    lora_config: dict[str, Any] | None = None
    experimental_configs: dict[str, Any] = Field(default_factory=dict)
    log_engine_metrics: bool | None = None

    @field_validator("runtime_env")
    @classmethod
    def _env_vars(cls, runtime_env: dict[str, Any]) -> dict[str, Any]:
        env = runtime_env.get("env_vars") or {}
        for key, value in env.items():
            if not isinstance(value, str):
                raise ValueError(
                    f"runtime_env.env_vars.{key}={value!r} is a {type(value).__name__}; "
                    f"Ray takes strings only. Fix: quote it ({key}: \"{value}\")."
                )
        for key in SECRET_ENV_VARS:
            if key in env:
                raise ValueError(
                    f"runtime_env.env_vars.{key} is set: a secret in the config leaks with "
                    "the config (git, `serve status`, manifests, and Ray's state API shows "
                    "every actor's runtime_env). Fix: remove it and export it in the "
                    "environment that starts Ray (a Kubernetes Secret on KubeRay).")
        plugins = env.get("VLLM_PLUGINS")
        if not rules.plugin_allowed(plugins):
            raise ValueError(
                f"runtime_env.env_vars.VLLM_PLUGINS={plugins!r} leaves out {PLUGIN_NAME!r}, "
                "so engine workers would build DeepSeek-V4 layers unpatched. Fix: add "
                f"{PLUGIN_NAME} to the list or remove VLLM_PLUGINS."
            )
        return runtime_env
