"""``AppArgs``: the whole ``args`` of ``deployments.app:build_app`` for one pool."""

from __future__ import annotations

from typing import Any

from pydantic import (
    Field,
)

from deployments.config import sizing
from deployments.config.base import WORKER_EXTENSION, _Strict
from deployments.config.dsv4 import DSv4Section
from deployments.config.http import HTTPEdge
from deployments.config.llm import LLMSection
from deployments.config.responses import ResponsesStore
from dsv4_patch import rules

# ------------------------------------------------------------------ app args

# vLLM reads the Responses store switch from the environment of the process that
# serves HTTP (``vllm.envs``); off, it drops ``store`` silently.
RESPONSES_STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"


def apply_http_to_engine(data: dict[str, Any], http: HTTPEdge) -> list[str]:
    """What ``http`` decides inside the engine, written into an ``LLMConfig`` dict;
    returns one line per value set, for the builder's log.

    * A request without a token limit generates up to ``max_model_len`` minus the prompt
      unless the generation config has a default (vLLM ``get_max_tokens``): that default
      is ``http.max_tokens`` (``override_generation_config.max_new_tokens``) unless the
      config sets one (``checks`` refuses one above ``http.max_tokens``).
    * The Responses store follows ``http.responses_store``, so the edge and vLLM agree
      whatever the node's environment says (``checks`` refuses a contradicting env var).
    """
    lines = []
    overrides = data["engine_kwargs"].setdefault("override_generation_config", {})
    if "max_new_tokens" not in overrides:
        overrides["max_new_tokens"] = http.max_tokens
        lines.append(f"engine_kwargs.override_generation_config.max_new_tokens="
                     f"{http.max_tokens} (http.max_tokens: the bound of a request that "
                     "sets no token limit)")
    env = data.setdefault("runtime_env", {}).setdefault("env_vars", {})
    if RESPONSES_STORE_ENV not in env:
        env[RESPONSES_STORE_ENV] = "1" if http.responses_store else "0"
        lines.append(f"runtime_env.env_vars.{RESPONSES_STORE_ENV}={env[RESPONSES_STORE_ENV]} "
                     f"(http.responses_store={str(http.responses_store).lower()})")
    return lines


class AppArgs(_Strict):
    """``args`` of ``deployments.app:build_app``: one DeepSeek-V4 model."""

    llm: LLMSection
    dsv4: DSv4Section = Field(default_factory=DSv4Section)
    http: HTTPEdge = Field(default_factory=HTTPEdge)
    # Where Responses state lives while http.responses_store is on (deployments.responses).
    responses: ResponsesStore = Field(default_factory=ResponsesStore)

    def parallel(self) -> sizing.Parallel:
        """The parallel layout of one engine and one replica (``deployments.config.sizing``)."""
        ek = self.llm.engine_kwargs
        return sizing.Parallel(ek.tensor_parallel_size, ek.pipeline_parallel_size,
                               ek.data_parallel_size, ek.enable_expert_parallel,
                               self.dsv4.node.nodes_per_replica)

    def actor_cpus(self) -> float:
        """CPUs of one Serve replica actor (``deployment_config.ray_actor_options``)."""
        opts = (self.llm.deployment_config.model_extra or {}).get("ray_actor_options") or {}
        return float(opts.get("num_cpus", sizing.REPLICA_ACTOR_CPUS))

    def replica_cpus(self) -> float:
        """CPUs one scaling unit reserves (``deployments.config.sizing.replica_cpus``)."""
        pg = self.llm.placement_group_config
        return sizing.replica_cpus(pg.bundles if pg else None, self.parallel(),
                                   self.actor_cpus())

    def block_size(self) -> int:
        """The KV cache block size the engines run (256 unless configured)."""
        return sizing.block_size(self.llm.engine_kwargs.block_size)

    @property
    def max_replicas_total(self) -> int:
        """Server replicas at most, over every pool (P/D apps have two)."""
        return self.llm.deployment_config.max_replicas

    @property
    def max_serving_replicas(self) -> int:
        """Serve replicas that answer HTTP at most (every DP rank is one):
        ``deployments.config.sizing.serve_replicas`` at ``max_replicas``."""
        return sizing.serve_replicas(self.llm.deployment_config.max_replicas, self.parallel())

    def predicted_layout(self, vllm_version: str | None = None) -> rules.LayoutDecision:
        """The layout the declared node gives under vLLM ``vllm_version`` (default: the
        platform's ``rules.DEFAULT_VLLM``), from the release tables; the replica asks
        its installed vLLM on its real node and refuses to start if they differ."""
        node = self.dsv4.node
        backend = self.llm.engine_kwargs.attention_backend or node.attention_backend
        return rules.detect_layout(node.platform, node.compute_capability, backend,
                                   vllm_version)

    def llm_config_dict(self, model_source: str | None = None) -> dict[str, Any]:
        """The dict for ``ray.serve.llm.LLMConfig`` (server_cls is set by build_app).

        ``model_source`` replaces the configured one (the tiny model alias becomes
        its directory); the worker extension is added because the controller
        needs it in every worker; the drain settings get our defaults.
        """
        data = self.llm.model_dump(mode="json", exclude_none=True)
        data["model_loading_config"]["model_source"] = (
            model_source or self.llm.model_loading_config.model_source
            or self.llm.model_loading_config.model_id
        )
        data["engine_kwargs"]["worker_extension_cls"] = WORKER_EXTENSION
        # Drain settings always explicit: a stopping replica finishes in-flight requests.
        deploy = self.llm.deployment_config
        data["deployment_config"]["graceful_shutdown_timeout_s"] = deploy.drain_timeout_s
        data["deployment_config"]["graceful_shutdown_wait_loop_s"] = deploy.drain_poll_s
        return data
