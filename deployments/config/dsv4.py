"""``args.dsv4``: the layout every replica must end up with, the controller's policy, the node."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from deployments.config.autoscaling import AutoscalingSection
from deployments.config.base import Policy, _Strict
from deployments.config.routing import RoutingSection
from dsv4_patch import rules

# -------------------------------------------------------------------- dsv4 part


class NodeSpec(_Strict):
    """The node one replica runs on, as declared: used to predict the layout.

    The replica re-probes its real node before building the engine and refuses
    to start if the probe contradicts ``expected_layout``.
    """

    platform: Literal["cpu", "cuda", "rocm", "xpu"] = "cpu"
    compute_capability: tuple[int, int] | None = None
    attention_backend: str | None = None
    gpus_per_node: int | None = Field(default=None, ge=1)
    # GPU presets (configs/*-h200.yaml ...): what `dsv4-serve plan` sizes the KV
    # cache with, and how many nodes one scaling unit spans (2 for a PP-across-nodes
    # replica; KubeRay renders numOfHosts from it).
    gpu_memory_gib: float | None = Field(
        default=None, gt=0, description="memory of one GPU as nvidia-smi reports it, in GiB"
    )
    nodes_per_replica: int = Field(default=1, ge=1)

    @field_validator("compute_capability", mode="before")
    @classmethod
    def _parse_capability(cls, value: Any) -> Any:
        """Accept "9.0", 9.0, [9, 0]; YAML users write capabilities all three ways."""
        if isinstance(value, (str, float)):
            text = str(value)
            major, _, minor = text.partition(".")
            if not (major.isdigit() and (minor or "0").isdigit()):
                raise ValueError(
                    f"compute_capability={value!r}: expected MAJOR.MINOR such as "
                    "\"9.0\" (H100/H200), \"10.0\" (B200) or \"12.0\" (RTX 50xx)."
                )
            return (int(major), int(minor or 0))
        return value

    @model_validator(mode="after")
    def _capability_for_cuda(self) -> NodeSpec:
        if self.platform == "cuda" and self.compute_capability is None:
            raise ValueError(
                "node.platform='cuda' without node.compute_capability: the DeepSeek-V4 "
                "layout depends on it. Fix: set compute_capability, e.g. \"9.0\" for "
                "H200 or \"10.0\" for B200."
            )
        return self


class ReplicaOverride(_Strict):
    """Engine settings for one replica rank only: a canary, or a mixed fleet on one box.

    Replicas of one deployment are identical by construction; on real clusters
    they still diverge (mixed GPU generations, rolling vLLM upgrades). This lets
    you run such a divergence on purpose and watch the controller catch it.
    """

    rank: int = Field(ge=0)
    engine_kwargs: dict[str, Any] = Field(min_length=1)
    reason: str = "canary"


ExpectedLayout = Literal["fp8_ds_mla", "nvfp4_ds_mla", "plain_rows"]
NODE_TYPES = ("sm90", "sm100", "sm120", "rocm", "xpu", "cpu")


def node_type_key(node: Mapping[str, Any]) -> str:
    """The ``expected_layouts`` key of a node: sm90, sm100, rocm...

    ``node`` is ``NodeInfo.as_dict()`` (capability "9.0") or a dumped ``NodeSpec``
    (capability [9, 0]): a replica and the planner must find the same key.
    """
    platform = str(node.get("platform") or "cpu")
    cap = node.get("compute_capability")
    if platform != "cuda" or not cap:
        return platform
    major = cap[0] if isinstance(cap, (list, tuple)) else str(cap).partition(".")[0]
    return f"sm{major}0"


class DSv4Section(_Strict):
    """What the KV-spec controller enforces across the replicas."""

    expected_layout: rules.Layout = rules.Layout.FP8_DS_MLA
    # Per node type (DeepSeek-V4.1's record depends on the GPU): e.g. {sm90: fp8_ds_mla,
    # sm100: nvfp4_ds_mla} for an H200 + B200 fleet; node types not listed use
    # expected_layout.
    expected_layouts: dict[str, ExpectedLayout] = Field(default_factory=dict)
    policy: Policy = Policy.ENFORCE
    controller_period_s: float = Field(default=10.0, gt=0, le=3600)
    # Each replica's own deadline for kv_page_spec / the verdict: a hung replica is
    # named no_answer after it while the others get their verdict in the same check.
    broadcast_timeout_s: float = Field(default=30.0, gt=0, le=600)
    status_timeout_s: float = Field(default=10.0, gt=0, le=600,
                                    description="bound on one serve.status() call")
    stale_after_s: float | None = Field(
        default=None, gt=0, description="a report older than this is `stale` and the "
        "controller fails its health check; default 3 periods + 2 timeouts")
    enforce_max_attempts: int = Field(default=3, ge=0, le=100, description="replacements "
                                      "of one odd rank before enforce drains it instead")
    enforce_backoff_s: float = Field(default=30.0, ge=0, le=3600, description="wait before "
                                     "the next replacement, doubled per attempt")
    node: NodeSpec = Field(default_factory=NodeSpec)
    # A fleet over several GPU types (one Serve deployment, one KubeRay worker group per
    # type): what `dsv4-serve plan` sizes per type and `k8s render` gives each group.
    # A replica never reads it: it probes its own GPU (deployments.serving.server.
    # probe_node) and takes its type's expected_layouts entry.
    node_types: dict[str, NodeSpec] = Field(default_factory=dict)
    # The vLLM the replicas' image runs (stack gpu: 0.29.0, gpu-v41: 0.33.0, gpu-v41-034: 0.34.0):
    # what `plan` predicts with unless --vllm-version says otherwise. Unset: the
    # platform's default stack (dsv4_patch.rules.DEFAULT_VLLM).
    vllm_version: str | None = Field(default=None, pattern=r"^\d+\.\d+\.\d+")
    replica_overrides: list[ReplicaOverride] = Field(default_factory=list)
    # When llm.deployment_config.autoscaling_config is set: the policy Serve scales by.
    autoscaling: AutoscalingSection = Field(default_factory=AutoscalingSection)
    # Session affinity (x-session-id) in Serve's router and HAProxy.
    routing: RoutingSection = Field(default_factory=RoutingSection)

    @property
    def stale_bound_s(self) -> float:
        """Age after which the last report is not to be trusted (and the controller restarts)."""
        if self.stale_after_s is not None:
            return self.stale_after_s
        return 3 * self.controller_period_s + 2 * self.broadcast_timeout_s + self.status_timeout_s

    @field_validator("expected_layouts")
    @classmethod
    def _known_node_types(cls, value: dict[str, str]) -> dict[str, str]:
        bad = sorted(set(value) - set(NODE_TYPES))
        if bad:
            raise ValueError(f"expected_layouts keys {bad} are not node types; expected "
                             f"some of {list(NODE_TYPES)} (sm90: H100/H200, sm100: B200).")
        return value

    @model_validator(mode="after")
    def _node_types_fit(self) -> DSv4Section:
        """Every node type holds one replica like ``node`` does (a DP gang fills a node)."""
        for key, spec in self.node_types.items():
            found = node_type_key(spec.model_dump(mode="json"))
            if found != key:
                raise ValueError(
                    f"node_types.{key}: platform={spec.platform!r}, compute_capability="
                    f"{spec.compute_capability} is node type {found!r}; expected {key!r}. "
                    f"Fix: key it {found!r} or correct its compute_capability.")
            for field in ("gpus_per_node", "nodes_per_replica"):
                if getattr(spec, field) != getattr(self.node, field):
                    raise ValueError(
                        f"node_types.{key}.{field}={getattr(spec, field)} but node.{field}="
                        f"{getattr(self.node, field)}: one deployment's replicas are alike, "
                        "so every node type must hold one replica the same way. Fix: use "
                        "equal values, or serve the node types as separate applications.")
        if self.node_types and node_type_key(self.node.model_dump(mode="json")) not in \
                self.node_types:
            raise ValueError(
                f"node_types {sorted(self.node_types)} lacks node's type "
                f"{node_type_key(self.node.model_dump(mode='json'))!r}: node is the fallback a "
                "replica uses when it cannot probe its GPU. Fix: make node one of node_types.")
        return self

    def nodes(self) -> dict[str, NodeSpec]:
        """Every node type this fleet runs on: ``node_types``, else ``node`` alone."""
        return dict(self.node_types) or {node_type_key(self.node.model_dump(mode="json")):
                                         self.node}

    def expected_for(self, node: Mapping[str, Any]) -> str:
        """The layout a replica on ``node`` must report: its node type's entry, else the default."""
        return self.expected_layouts.get(node_type_key(node), self.expected_layout.value)

    def override_for(self, rank: int | None) -> ReplicaOverride | None:
        return next((o for o in self.replica_overrides if o.rank == rank), None)
