"""deployments.config.sizing: one replica sized the same way by config, plan, k8s and the runner."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployments.config import checks, load_serve_config, parse_app_args, sizing
from deployments.local.ray_head import logical_cpus_needed
from dsv4_patch import rules
from dsv4_patch.rules.byte_model import (
    FP8_DS_MLA_SCALE_BYTES,
    FP8_DS_MLA_TOKEN_DATA_BYTES,
    HEAD_DIM,
    INDEX_HEAD_DIM,
    ROPE_DIM,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_parallel_counts():
    par = sizing.Parallel(tp=2, pp=2, dp=4, ep=True, nodes=2)
    assert (par.gpus_per_engine, par.gpus_per_replica, par.ep_size) == (4, 16, 8)
    assert sizing.Parallel(tp=8, pp=1).ep_size == 1


def test_replica_cpus_count_every_dp_rank_with_its_actor():
    par = sizing.Parallel(tp=1, pp=1, dp=8, ep=True)
    assert sizing.replica_cpus([{"GPU": 1, "CPU": 8}], par) == 8 * (8 + 1)
    assert sizing.replica_cpus(None, sizing.Parallel(1, 1)) == 2.0  # actor + {CPU: 1}
    assert sizing.cluster_cpus([(2, 2.0), (1, 3.0)]) == 4 + 3  # no ingress replica


def test_runner_and_k8s_agree_on_a_dp_preset():
    """The local runner and the k8s CPU check read one number (they used to differ by DP)."""
    config = load_serve_config(CONFIGS / "flash-h200.yaml")
    [(_, args)] = config.ours()
    per_replica = args.replica_cpus()
    assert per_replica == 8 * (8 + 1)  # 8 DP ranks x (8 CPU bundle + 1 replica actor)
    top = args.llm.deployment_config.max_replicas
    assert logical_cpus_needed(config) == top * per_replica


def test_block_size_is_the_rules_constant():
    assert sizing.block_size(None) == rules.DSV4_BLOCK_SIZE == 256
    assert sizing.block_size(64) == 64


def test_rules_hold_the_fp8_ds_mla_geometry():
    shape = rules.ModelShape(num_layers=1, compress_ratios=(4,), head_dim=HEAD_DIM,
                             rope_dim=ROPE_DIM, index_head_dim=INDEX_HEAD_DIM)
    record = FP8_DS_MLA_TOKEN_DATA_BYTES + FP8_DS_MLA_SCALE_BYTES
    assert record == rules.state_bytes(shape, rules.Storage.FP8_DS_MLA) == 584


def _local() -> dict:
    return load_serve_config(CONFIGS / "local-cpu.yaml").applications[0].args


def test_check_returns_problems_and_the_loader_raises_them():
    args = _local()
    args["llm"]["engine_kwargs"]["block_size"] = 64
    args["llm"]["accelerator_type"] = "H100"
    parsed = parse_app_args(args, refuse=False)
    codes = [p.code for p in checks.check(parsed)]
    assert codes == ["cpu-block-size", "accelerator-on-cpu"]
    with pytest.raises(ValueError, match="block_size=64 on a CPU node") as info:
        parse_app_args(args)
    assert "accelerator_type='H100'" in str(info.value)  # every problem, not the first


def test_lora_is_refused_not_ignored():
    """lora_config is never accepted and ignored: the server replicas route no adapters
    (issue 16 removed the ingress that did), and a CPU node (no LoRA in vLLM's CPU
    DeepSeek-V4 model) refuses it already in the config."""
    from deployments.serving.builder import build_one_pool_app, refuse_lora, server_config

    raw = load_serve_config(CONFIGS / "flash-sm120.yaml").applications[0].args
    raw["llm"]["lora_config"] = {"dynamic_lora_loading_path": "s3://bucket/loras"}
    with pytest.raises(ValueError, match="lora_config is set"):  # before anything is built
        build_one_pool_app(parse_app_args(raw))
    del raw["llm"]["lora_config"]
    refuse_lora(server_config(parse_app_args(raw)).get("lora_config"))
    local = _local()
    local["llm"]["lora_config"] = {"dynamic_lora_loading_path": "s3://bucket/loras"}
    with pytest.raises(ValueError, match="lora_config is set on a CPU node"):
        parse_app_args(local)


def test_vllm_plugins_parsed_as_vllm_does():
    """One parse for config and doctor, vLLM's own: a space before the name hides it."""
    assert rules.plugin_allowed(None) and rules.plugin_allowed("a,dsv4_patch")
    assert not rules.plugin_allowed("a, dsv4_patch") and not rules.plugin_allowed("")


def test_pool_replicas_pack_gpu_nodes():
    """P/D pools share nodes: 1 TP4 prefill + 1 TP4 decode = one 8-GPU node."""
    assert sizing.nodes_for([(1, 4), (1, 4)], 8) == 1
    assert sizing.nodes_for([(2, 4), (5, 4)], 8) == 4
    assert sizing.nodes_for([(3, 4), (2, 2)], 8) == 2  # 16 GPUs: 4+4 | 4+2+2
    assert sizing.nodes_for([(0, 3), (1, 8)], 8) == 1  # an empty pool does not count
    for bad in ([(1, 3), (1, 4)], [(1, 16)], [(1, 2), (1, 6)]):
        with pytest.raises(ValueError, match="divide the node's GPU count"):
            sizing.nodes_for(bad, 8)
