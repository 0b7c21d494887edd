"""Our part of a Ray Serve config, validated before Ray starts anything.

The YAML is the ordinary Serve config format (what ``serve run``, ``serve deploy``
and KubeRay's ``serveConfigV2`` take)::

    applications:
      - name: dsv4
        route_prefix: /
        import_path: deployments.app:build_app
        args: {llm: {...}, dsv4: {...}}

Only ``args`` of applications whose ``import_path`` is ours is modelled here.
``args.llm`` mirrors Ray Serve LLM's ``LLMConfig`` field names, so a Ray Serve LLM
user can paste what they know; we type the parts that decide the KV layout and
the replica shape (kv_cache_dtype, parallel sizes, placement group, autoscaling)
and pass the rest through to ``LLMConfig``, which validates it again.
``args.dsv4`` is ours: the layout every replica must end up with, the policy the
KV-spec controller applies, and the node the replicas run on.

The models check structure (types, ranges, unknown keys, one-field rules); the
policy rules that tie sections together are ``deployments.checks.check``, which
``parse_app_args`` and ``load_serve_config`` apply (``refuse=False`` leaves them to
the caller: ``dsv4-serve plan`` reports them). Sizing lives in ``deployments.sizing``.

Every error names the field, the bad value, what was expected and the fix:
these messages are what a user sees before anything starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from deployments import checks, resources, sizing
from dsv4_patch import rules
from dsv4_patch.tiny_model import TINY_MODEL_NAME

IMPORT_PATH = "deployments.app:build_app"
WORKER_EXTENSION = "dsv4_patch.worker_ext.DSv4WorkerExtension"
# model_source alias of the tiny random-weight DeepSeek-V4 (one name: dsv4_patch.tiny_model).
TINY_MODEL_SOURCE = TINY_MODEL_NAME
PLUGIN_NAME = rules.PLUGIN_NAME
DEFAULT_CONFIG = resources.configs_dir() / "local-cpu.yaml"
# Seconds a stopping DSv4 server replica waits for its in-flight requests (Serve's
# graceful_shutdown_timeout_s; Serve's own default of 20 s cuts long generations).
DEFAULT_DRAIN_TIMEOUT_S = 60.0
# How often a draining replica re-counts its requests (Serve's default is 2 s).
DEFAULT_DRAIN_POLL_S = 0.5
# Where the HTTP edge reads API keys (deployments/auth.py); never from the YAML.
DEFAULT_API_KEYS_ENV = "DSV4_API_KEYS"
DEFAULT_API_KEYS_FILE_ENV = "DSV4_API_KEYS_FILE"
# Secrets that must never sit in runtime_env (the state API echoes runtime_env back).
SECRET_ENV_VARS = (DEFAULT_API_KEYS_ENV, "VLLM_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


class Policy(str, Enum):
    """What the controller does with a replica whose KV spec disagrees."""

    ENFORCE = "enforce"  # fails its health check (Serve replaces it), bounded, then drain
    DRAIN = "drain"  # stays up for inspection; the request router sends it no requests
    WARN = "warn"  # reported over HTTP/metrics/logs; the replica keeps serving


class _Strict(BaseModel):
    """Unknown keys are typos until proven otherwise: reject them by name."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class _Open(BaseModel):
    """Typed where we decide something; everything else passes through untouched."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)


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
        if value not in (None, WORKER_EXTENSION):
            raise ValueError(
                f"worker_extension_cls={value!r}: the KV-spec controller needs "
                f"{WORKER_EXTENSION!r} in every worker. Fix: remove the key "
                "(dsv4-serve sets it)."
            )
        return value


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


class DSv4Section(_Strict):
    """What the KV-spec controller enforces across the replicas."""

    expected_layout: rules.Layout = rules.Layout.FP8_DS_MLA
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
    replica_overrides: list[ReplicaOverride] = Field(default_factory=list)

    @property
    def stale_bound_s(self) -> float:
        """Age after which the last report is not to be trusted (and the controller restarts)."""
        if self.stale_after_s is not None:
            return self.stale_after_s
        return 3 * self.controller_period_s + 2 * self.broadcast_timeout_s + self.status_timeout_s

    def override_for(self, rank: int | None) -> ReplicaOverride | None:
        return next((o for o in self.replica_overrides if o.rank == rank), None)


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
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    stream_max_s: float = Field(default=1800.0, gt=0)
    stream_idle_s: float = Field(default=120.0, gt=0)
    # A refresh of /v1/kv-spec runs 2N RPCs: at most one per interval per ingress replica.
    kv_spec_refresh_interval_s: float = Field(default=1.0, ge=0, le=3600)

    @field_validator("cors_allow_origins")
    @classmethod
    def _no_wildcard(cls, origins: list[str]) -> list[str]:
        if "*" in origins:
            raise ValueError(
                "cors_allow_origins contains '*': any web page could then call the API "
                "with a visitor's browser. Fix: list the origins, e.g. "
                "[\"https://chat.example.com\"].")
        return origins


# ------------------------------------------------------------------ app args


class AppArgs(_Strict):
    """``args`` of ``deployments.app:build_app``: one DeepSeek-V4 model."""

    llm: LLMSection
    dsv4: DSv4Section = Field(default_factory=DSv4Section)
    http: HTTPEdge = Field(default_factory=HTTPEdge)

    def parallel(self) -> sizing.Parallel:
        """The parallel layout of one engine and one replica (``deployments.sizing``)."""
        ek = self.llm.engine_kwargs
        return sizing.Parallel(ek.tensor_parallel_size, ek.pipeline_parallel_size,
                               ek.data_parallel_size, ek.enable_expert_parallel,
                               self.dsv4.node.nodes_per_replica)

    def actor_cpus(self) -> float:
        """CPUs of one Serve replica actor (``deployment_config.ray_actor_options``)."""
        opts = (self.llm.deployment_config.model_extra or {}).get("ray_actor_options") or {}
        return float(opts.get("num_cpus", sizing.REPLICA_ACTOR_CPUS))

    def replica_cpus(self) -> float:
        """CPUs one scaling unit reserves (``deployments.sizing.replica_cpus``)."""
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


# ------------------------------------------------------------ whole Serve file


class ServeApplication(_Open):
    """One entry of ``applications``; other builders' args are not ours to judge."""

    name: str = "default"
    route_prefix: str | None = "/"
    import_path: str
    args: dict[str, Any] = Field(default_factory=dict)
    # Our args, parsed once (by the loader or the first ``parsed`` call) and kept.
    _parsed: AppArgs | None = PrivateAttr(default=None)

    @property
    def is_ours(self) -> bool:
        return self.import_path == IMPORT_PATH

    @property
    def where(self) -> str:
        return f"applications[{self.name}].args"

    def parse(self, *, refuse: bool = True, label: str | None = None) -> AppArgs:
        """Parse ``args`` (again: after an in-place change) and keep the model.

        ``refuse`` raises on policy problems (``deployments.checks``) too.
        """
        self._parsed = parse_app_args(self.args, self.where, refuse=refuse, label=label)
        return self._parsed

    @property
    def parsed(self) -> AppArgs:
        """The validated args (parsed on first use, refusing policy problems)."""
        return self._parsed if self._parsed is not None else self.parse()


# Serve's own default bind address for a config file (ray.serve.schema.HTTPOptionsSchema:
# what `serve deploy` and KubeRay use when http_options.host is absent). `dsv4-serve run`
# uses the same, so one file binds one address whichever launcher runs it.
SERVE_DEFAULT_HOST = "0.0.0.0"


class HTTPOptions(_Open):
    host: str = SERVE_DEFAULT_HOST
    port: int = Field(default=8000, ge=1, le=65535)


class ServeConfig(_Open):
    """A Serve config file: ``http_options`` and ``applications``."""

    http_options: HTTPOptions = Field(default_factory=HTTPOptions)
    applications: list[ServeApplication] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_routes(self) -> ServeConfig:
        names = [a.name for a in self.applications]
        routes = [a.route_prefix for a in self.applications if a.route_prefix]
        for label, values in (("name", names), ("route_prefix", routes)):
            dupes = sorted({v for v in values if values.count(v) > 1})
            if dupes:
                raise ValueError(
                    f"applications[].{label} {dupes} used more than once; Serve needs "
                    f"each {label} unique. Fix: rename one of them."
                )
        return self

    def ours(self) -> list[tuple[ServeApplication, AppArgs]]:
        """Our applications with their validated args (parsed once, kept)."""
        return [(a, a.parsed) for a in self.applications if a.is_ours]


# ------------------------------------------------------------------ errors


class ConfigError(ValueError):
    """A config the user must fix; the message lists every problem by field."""


def _fmt_loc(prefix: str, loc: tuple[Any, ...]) -> str:
    parts = [prefix] if prefix else []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        else:
            parts.append(str(item))
    return ".".join(parts) or "<root>"


def format_validation_error(exc: ValidationError, prefix: str) -> str:
    """One line per problem: where, what was given, what was expected (and the fix)."""
    lines = []
    for err in exc.errors(include_url=False):
        where = _fmt_loc(prefix, tuple(err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key. Fix: remove it or check the spelling"
        elif err["type"] == "missing":
            msg = "required key is missing. Fix: add it"
        got = err.get("input")
        shown = "" if err["type"] in ("missing",) or isinstance(got, Mapping) else f" (got {got!r})"
        lines.append(f"  {where}: {msg}{shown}")
    return "\n".join(lines)


def args_model(args: Mapping[str, Any]) -> type[AppArgs]:
    """``AppArgs``, or its P/D form when ``args`` has a ``pd`` section."""
    if "pd" in args:
        from deployments.pd_config import PDAppArgs  # imports this module

        return PDAppArgs
    return AppArgs


def refuse_problems(problems: list[checks.Problem], where: str,
                    label: str | None = None) -> None:
    """Raise ConfigError listing every error problem of ``check`` (warnings pass)."""
    found = checks.errors(problems)
    if found:
        lines = "\n".join(f"  {where}: {p.message}" for p in found)
        raise ConfigError(f"invalid {label or where}:\n{lines}")


def parse_app_args(args: Mapping[str, Any], where: str = "args", *, refuse: bool = True,
                   label: str | None = None) -> AppArgs:
    """Validate ``build_app`` args or raise ConfigError naming each bad field.

    Structure first (the pydantic models), then the policy rules of
    ``deployments.checks.check``; ``refuse=False`` keeps the policy problems for the
    caller to report (``dsv4-serve plan``). ``label`` names the file in the message.
    """
    try:
        parsed = args_model(args).model_validate(dict(args))
    except ValidationError as exc:
        raise ConfigError(f"invalid {label or where}:\n"
                          f"{format_validation_error(exc, where)}") from exc
    if refuse:
        refuse_problems(checks.check(parsed), where, label)
    return parsed


def load_serve_config(path: str | Path, *, refuse: bool = True) -> ServeConfig:
    """Read and validate a Serve config YAML, including our applications' args.

    Our args are parsed here once and kept on each application (``parsed``);
    ``refuse=False`` leaves policy problems to the caller (``deployments.checks``).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist. Fix: pass a Serve "
                          f"config YAML, e.g. {DEFAULT_CONFIG}.")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with `applications:`, got "
                          f"{type(raw).__name__}.")
    try:
        config = ServeConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"invalid {path}:\n{format_validation_error(exc, '')}") from exc
    if not any(a.is_ours for a in config.applications):
        raise ConfigError(
            f"{path}: no application has import_path {IMPORT_PATH!r}. Fix: add one."
        )
    for app in config.applications:
        if app.is_ours:
            app.parse(refuse=refuse, label=str(path))
    return config
