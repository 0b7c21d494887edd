"""``args.pd``: prefill/decode disaggregation, validated before Ray starts.

A P/D app is one model served by two pools of DSv4 server replicas: prefill engines
(``kv_role: kv_producer``) compute the prompt's KV pages and decode engines
(``kv_consumer``) pull them over the KV connector and generate. ``args.llm`` is what
both pools share; ``pd.prefill`` / ``pd.decode`` change only what differs per pool
(replica count, engine kwargs, another copy of the model, env vars, a canary)::

    args:
      llm: {...}                       # as for one pool
      pd:
        kv_transfer_config: {kv_connector: NixlConnector, kv_buffer_device: cpu}
        prefill: {deployment_config: {num_replicas: 1}}
        decode: {deployment_config: {num_replicas: 1}}

``kv_role`` is ours to set (producer for prefill, consumer for decode). The
controller proves every prefill replica KV-compatible with every decode replica
before it routes a request between them (``deployments.pd.compat``).
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from deployments.config import sizing
from deployments.config.app_args import AppArgs
from deployments.config.base import _Strict
from deployments.config.dsv4 import NodeSpec, ReplicaOverride
from deployments.config.llm import DeploymentConfig
from deployments.logs import get_logger

# Connectors that declare support for vLLM's hybrid KV cache manager: vLLM turns HMA
# off for the others, and DeepSeek-V4 then dies at start (ExampleConnector:
# "MLAAttentionSpec.__init__() got an unexpected keyword argument 'bounded_replay'").
HMA_CONNECTORS = ("NixlConnector",)
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
POOLS = ("prefill", "decode")
# vLLM 0.32 config/kv_transfer.py: KVTransferConfig.kv_load_failure_policy.
LOAD_FAILURE_POLICIES = ("fail", "recompute")

logger = get_logger("config")


class PoolSection(_Strict):
    """What one pool changes over ``args.llm``."""

    model_source: str | None = Field(default=None, description="another copy of the "
                                     "model (e.g. a node-local path); compared by content")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    deployment_config: dict[str, Any] = Field(default_factory=dict)
    env_vars: dict[str, str] = Field(default_factory=dict)
    replica_overrides: list[ReplicaOverride] = Field(default_factory=list)
    node: NodeSpec | None = Field(default=None, description="this pool's node (platform, "
                                  "compute_capability, attention_backend) when it differs "
                                  "from dsv4.node: P/D across GPU types")
    vllm_version: str | None = Field(default=None, pattern=r"^\d+\.\d+\.\d+",
                                     description="the vLLM this pool's image runs when it "
                                     "differs from dsv4.vllm_version (unset: the app's)")

    @field_validator("engine_kwargs")
    @classmethod
    def _no_role_or_transfer(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in ("kv_transfer_config", "kv_cache_dtype", "worker_extension_cls"):
            if key in value:
                raise ValueError(
                    f"engine_kwargs.{key} is set per pool: {key} must be the same in both "
                    f"pools. Fix: set it once (pd.kv_transfer_config, llm.engine_kwargs).")
        return value


class CanarySection(_Strict):
    """The P/D output canary (``deployments.pd.canary``): a pair joins the routing
    whitelist only after a fixed greedy request through it scores the same as on the
    decode replica alone, and leaves it when a later canary does not."""

    enabled: bool = Field(default=True, description="run the output canary per (prefill, "
                          "decode) pair; off: pairs are judged by their specs alone")
    period_s: float = Field(default=300.0, ge=5.0, description="seconds between canaries of "
                            "one pair; a failing pair is excluded within one period")
    prompt_tokens: int = Field(default=700, ge=300, description="canary prompt length: "
                               "several KV blocks, across the C4/C128 compression boundaries")
    max_tokens: int = Field(default=8, ge=2, le=64, description="tokens decoded per canary")
    tolerance: float | None = Field(default=None, gt=0, description="largest per-token "
                                    "logprob difference (nats) that passes; None: the "
                                    "platform's measured bound (deployments.pd.canary)")
    median_tolerance: float | None = Field(default=None, gt=0, description="largest median "
                                           "per-token logprob difference (nats) that "
                                           "passes; None: the platform's measured bound "
                                           "(CPU 0.1; GPU none measured: not judged)")
    timeout_s: float = Field(default=120.0, gt=0, description="one canary's deadline")


class PDSection(_Strict):
    """The two pools, the connector they share, and our compatibility check."""

    kv_transfer_config: dict[str, Any] = Field(
        default_factory=lambda: {"kv_connector": "NixlConnector"},
        description="vLLM's KVTransferConfig without kv_role (set per pool)")
    compat_check: bool = Field(default=True, description="route prefill -> decode only "
                               "between replicas proven KV-compatible (deployments.pd.compat)")
    on_incompatible: Literal["local"] = Field(
        default="local", description="a decode replica without a compatible prefill "
        "replica prefills on its own engine (no transfer)")
    prefill: PoolSection = Field(default_factory=PoolSection)
    decode: PoolSection = Field(default_factory=PoolSection)
    canary: CanarySection = Field(default_factory=CanarySection)

    @field_validator("kv_transfer_config")
    @classmethod
    def _connector(cls, value: dict[str, Any]) -> dict[str, Any]:
        connector = value.get("kv_connector")
        if connector not in HMA_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config.kv_connector={connector!r}: DeepSeek-V4 needs vLLM's "
                "hybrid KV cache manager, and vLLM turns it off for connectors that do not "
                f"declare support (the engine then dies at start). Expected one of "
                f"{list(HMA_CONNECTORS)}. Fix: kv_connector: NixlConnector.")
        if "kv_role" in value:
            raise ValueError(
                f"kv_transfer_config.kv_role={value['kv_role']!r}: the role is per pool "
                "(prefill kv_producer, decode kv_consumer) and dsv4-serve sets it. Fix: "
                "remove kv_role.")
        policy = value.get("kv_load_failure_policy", "fail")
        if policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_transfer_config.kv_load_failure_policy={policy!r}: vLLM 0.32's "
                f"KVTransferConfig takes {list(LOAD_FAILURE_POLICIES)} (vllm#52276: a failed "
                "receive answered 200 with garbage). Fix: fail (the request errors) or "
                "recompute (the decode engine recomputes the missing blocks).")
        return value

    @model_validator(mode="after")
    def _handshake_compat(self) -> PDSection:
        """NIXL's own hash off is acceptable only with our check on.

        With ``enforce_handshake_compat: false`` vLLM checks nothing before a transfer
        (it still logs "compatibility check passed"); recipes set it because the hash
        covers the model path string (docs/pd.md).
        """
        extra = self.kv_transfer_config.get("kv_connector_extra_config") or {}
        if extra.get("enforce_handshake_compat", True) is False and not self.compat_check:
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config.enforce_handshake_compat="
                "false with pd.compat_check=false: then nothing compares the prefill and "
                "decode KV layouts before pages are copied, and a mismatch decodes garbage "
                "silently. Fix: set pd.compat_check: true (our check compares the model by "
                "content, so a copy at another path passes), or remove "
                "enforce_handshake_compat.")
        return self

    def pool(self, name: str) -> PoolSection:
        return self.prefill if name == "prefill" else self.decode

    def transfer_config(self, pool: str) -> dict[str, Any]:
        """vLLM's ``kv_transfer_config`` of one pool. ``kv_load_failure_policy`` is written
        down (``fail``, vLLM 0.32's default, when unset): a failed receive must end the
        request with an error, never a 200 over pages that did not arrive."""
        return {"kv_load_failure_policy": "fail"} | copy.deepcopy(self.kv_transfer_config) \
            | {"kv_role": ROLES[pool]}


class PDAppArgs(AppArgs):
    """``args`` of ``deployments.app:build_app`` for a P/D app: ``llm`` plus ``pd``."""

    pd: PDSection = Field(default_factory=PDSection)

    @model_validator(mode="after")
    def _pools(self) -> PDAppArgs:
        if "kv_transfer_config" in (self.llm.engine_kwargs.model_extra or {}):
            raise ValueError(
                "llm.engine_kwargs.kv_transfer_config is set in a P/D app: the role differs "
                "per pool. Fix: move it to pd.kv_transfer_config (without kv_role).")
        if self.llm.engine_kwargs.data_parallel_size > 1:
            raise ValueError(
                "llm.engine_kwargs.data_parallel_size > 1 in a P/D app: dsv4-serve builds "
                "P/D pools of one engine per replica. Fix: data_parallel_size: 1 and "
                "scale each pool with pd.<pool>.deployment_config.")
        for name in POOLS:
            deploy = self.pool_deployment_config(name)
            for i, override in enumerate(self.pd.pool(name).replica_overrides):
                if override.rank >= deploy.max_replicas:
                    raise ValueError(
                        f"pd.{name}.replica_overrides[{i}].rank={override.rank} but the "
                        f"{name} pool runs at most {deploy.max_replicas} replica(s). Fix: "
                        f"pick a rank below {deploy.max_replicas}.")
        return self

    def pool_deployment_config(self, pool: str) -> DeploymentConfig:
        base = self.llm.deployment_config.model_dump(exclude_none=True)
        own = self.pd.pool(pool).deployment_config
        if {"num_replicas", "autoscaling_config"} & own.keys():
            base.pop("num_replicas", None)
            base.pop("autoscaling_config", None)
        try:
            return DeploymentConfig.model_validate(base | copy.deepcopy(own))
        except ValueError as exc:
            raise ValueError(f"pd.{pool}.deployment_config: {exc}") from exc

    def pool_parallel(self, pool: str) -> sizing.Parallel:
        """One replica of ``pool``: ``llm.engine_kwargs`` with the pool's own changes."""
        ek, own = self.llm.engine_kwargs, self.pd.pool(pool).engine_kwargs
        return sizing.Parallel(int(own.get("tensor_parallel_size", ek.tensor_parallel_size)),
                               int(own.get("pipeline_parallel_size",
                                           ek.pipeline_parallel_size)),
                               1, bool(own.get("enable_expert_parallel",
                                               ek.enable_expert_parallel)),
                               self.dsv4.node.nodes_per_replica)

    def pool_replica_cpus(self, pool: str) -> float:
        """CPUs one replica of ``pool`` reserves (its actor options, the shared bundles)."""
        extra = self.pool_deployment_config(pool).model_extra or {}
        actor = float((extra.get("ray_actor_options") or {}).get(
            "num_cpus", sizing.REPLICA_ACTOR_CPUS))
        pg = self.llm.placement_group_config
        return sizing.replica_cpus(pg.bundles if pg else None, self.pool_parallel(pool), actor)

    @property
    def max_replicas_total(self) -> int:
        return sum(self.pool_deployment_config(p).max_replicas for p in POOLS)

    def pool_llm_config_dict(self, pool: str, model_source: str | None) -> dict[str, Any]:
        """The ``LLMConfig`` dict of one pool: ``llm`` with the pool's changes merged in."""
        section = self.pd.pool(pool)
        data = self.llm_config_dict(section.model_source or model_source)
        data["engine_kwargs"] |= copy.deepcopy(section.engine_kwargs)
        data["engine_kwargs"]["kv_transfer_config"] = self.pd.transfer_config(pool)
        deploy = self.pool_deployment_config(pool).model_dump(mode="json", exclude_none=True)
        deploy["graceful_shutdown_timeout_s"] = data["deployment_config"][
            "graceful_shutdown_timeout_s"]
        deploy["graceful_shutdown_wait_loop_s"] = data["deployment_config"][
            "graceful_shutdown_wait_loop_s"]
        data["deployment_config"] = deploy
        env = data.setdefault("runtime_env", {}).setdefault("env_vars", {})
        env |= section.env_vars
        return data

    def pool_dsv4(self, pool: str) -> dict[str, Any]:
        """The ``dsv4`` section one pool's replicas and controller see (its own canaries)."""
        data = self.dsv4.model_dump(mode="json")
        data["replica_overrides"] = [o.model_dump(mode="json")
                                     for o in self.pd.pool(pool).replica_overrides]
        data["node"] = self.pool_node(pool).model_dump(mode="json")
        data["vllm_version"] = self.pool_vllm_version(pool)
        return data

    def pool_vllm_version(self, pool: str, app_version: str | None = None) -> str | None:
        """The vLLM one pool runs: its own ``vllm_version``, else ``app_version`` (what
        the app predicts with), else ``dsv4.vllm_version``; the fallback is logged."""
        own = self.pd.pool(pool).vllm_version
        if own is not None:
            return own
        resolved = app_version or self.dsv4.vllm_version
        logger.info("pd.%s.vllm_version unset: the %s pool runs the app's vLLM %s",
                    pool, pool, resolved or "(platform default)")
        return resolved

    def pool_node(self, pool: str) -> NodeSpec:
        """The node one pool's replicas run on: its own ``node``, else ``dsv4.node``."""
        return self.pd.pool(pool).node or self.dsv4.node
