"""GPU presets in configs/: auto everywhere, DeepSeek-V4 flags, sourced choices."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from deployments.config import IMPORT_PATH, ConfigError, load_serve_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
V4_GPU_PRESETS = ["flash-h200", "flash-b200", "flash-sm120", "pro-h200-2node"]
V41_PRESETS = ["v41-flash-h200", "v41-flash-b200", "v41-flash-mixed"]
GPU_PRESETS = [*V4_GPU_PRESETS, *V41_PRESETS]
REFUSED = "flash-b200-flashinfer-rows"
ALL = [*GPU_PRESETS, REFUSED]

DSV4_FLAGS = {
    "block_size": 256,
    "tokenizer_mode": "deepseek_v4",
    "tool_call_parser": "deepseek_v4",
    "reasoning_parser": "deepseek_v4",
    "enable_auto_tool_choice": True,
}
# DeepSeek-V4.1 (vLLM 0.30+ registries): its own chat encoding and parsers; the block
# size is vLLM's per-GPU default (64 on SM90, 128 on SM100), so presets leave it out.
DSV41_FLAGS = {
    "block_size": None,
    "tokenizer_mode": "deepseek_v41",
    "tool_call_parser": "deepseek_v41",
    "reasoning_parser": "deepseek_v41",
    "enable_auto_tool_choice": True,
}


def _flags(name: str) -> dict:
    return DSV41_FLAGS if name in V41_PRESETS else DSV4_FLAGS
# Choices that must say where they come from (a PR, issue, recipe or measurement).
SOURCED_KEYS = (*DSV4_FLAGS, "data_parallel_size", "tensor_parallel_size",
                "pipeline_parallel_size", "enable_expert_parallel", "gpu_memory_utilization",
                "gpu_memory_gib", "compute_capability", "max_model_len")


def _raw(name: str) -> dict:
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())


def _engine(name: str) -> dict:
    return _raw(name)["applications"][0]["args"]["llm"]["engine_kwargs"]


def test_preset_set_is_complete():
    names = {p.stem for p in CONFIGS.glob("*.yaml")}
    assert set(ALL) <= names


@pytest.mark.parametrize("name", ALL)
def test_every_preset_keeps_auto_and_our_builder(name):
    (app,) = _raw(name)["applications"]
    assert app["import_path"] == IMPORT_PATH
    assert _engine(name)["kv_cache_dtype"] == "auto"


@pytest.mark.parametrize("name", ALL)
def test_deepseek_v4_serving_flags(name):
    engine = _engine(name)
    assert {k: engine.get(k) for k in _flags(name)} == _flags(name)


@pytest.mark.parametrize("name", ALL)
def test_choices_are_commented_with_a_source(name):
    lines = (CONFIGS / f"{name}.yaml").read_text().splitlines()
    for key in SOURCED_KEYS:
        for line in (ln for ln in lines if re.match(rf"\s*{key}:", ln)):
            assert "#" in line, f"{name}: `{line.strip()}` has no source comment"


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_presets_validate_and_fill_their_nodes(name):
    (_, args), = load_serve_config(CONFIGS / f"{name}.yaml").ours()
    node = args.dsv4.node
    assert node.platform == "cuda" and node.gpu_memory_gib and node.gpus_per_node
    assert args.parallel().gpus_per_replica == node.gpus_per_node * node.nodes_per_replica
    assert args.dsv4.expected_layout.value == "fp8_ds_mla"
    assert args.dsv4.policy.value == "enforce"
    auto = args.llm.deployment_config.autoscaling_config
    assert auto is not None and auto.min_replicas >= 1 and auto.max_replicas > auto.min_replicas
    assert auto.target_ongoing_requests  # Ray Serve LLM's default target never scales


def test_flash_runs_dp_attention_with_expert_parallel_on_8_gpu_nodes():
    for name in ("flash-h200", "flash-b200", *V41_PRESETS):
        engine = _engine(name)
        assert (engine["data_parallel_size"], engine["tensor_parallel_size"]) == (8, 1)
        assert engine["enable_expert_parallel"] is True


def test_pro_spans_two_nodes_with_tp_inside_and_pp_across():
    (_, args), = load_serve_config(CONFIGS / "pro-h200-2node.yaml").ours()
    ek, pg = args.llm.engine_kwargs, args.llm.placement_group_config
    assert (ek.tensor_parallel_size, ek.pipeline_parallel_size) == (8, 2)
    assert args.dsv4.node.nodes_per_replica == 2
    assert pg is not None and pg.strategy == "PACK" and len(pg.bundles) == 16
    assert ek.model_extra["distributed_executor_backend"] == "ray"


def test_refused_preset_is_rejected_by_the_config_model():
    with pytest.raises(ConfigError) as info:
        load_serve_config(CONFIGS / f"{REFUSED}.yaml")
    message = str(info.value)
    assert "expected_layout='fp8_ds_mla'" in message and "plain_rows" in message
    assert "Fix:" in message


def _assert_rejected(raw: dict, tmp_path, match: str) -> None:
    """The edited preset, loaded from a file as a user would, fails naming ``match``."""
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=match):
        load_serve_config(path)


def test_dp_without_expert_parallel_is_rejected(tmp_path):
    raw = _raw("flash-h200")
    del raw["applications"][0]["args"]["llm"]["engine_kwargs"]["enable_expert_parallel"]
    _assert_rejected(raw, tmp_path, "enable_expert_parallel")


def test_strict_pack_across_nodes_is_rejected(tmp_path):
    raw = _raw("pro-h200-2node")
    raw["applications"][0]["args"]["llm"]["placement_group_config"]["strategy"] = "STRICT_PACK"
    _assert_rejected(raw, tmp_path, "strategy: PACK")


def test_replica_larger_than_its_nodes_is_rejected(tmp_path):
    raw = _raw("pro-h200-2node")
    raw["applications"][0]["args"]["dsv4"]["node"]["nodes_per_replica"] = 1
    raw["applications"][0]["args"]["llm"]["placement_group_config"]["strategy"] = "PACK"
    _assert_rejected(raw, tmp_path, "raise nodes_per_replica")


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_ray_accepts_the_presets(name):
    """Ray's own models: the Serve deploy schema (what KubeRay posts) and LLMConfig.

    Ray Serve LLM routes every engine_kwargs key to vLLM's engine or front-end
    arguments and rejects unknown ones, so this also proves the DeepSeek-V4 flags
    are real vLLM arguments (tool-call flags go to the OpenAI front-end).
    """
    schema = pytest.importorskip("ray.serve.schema")
    llm = pytest.importorskip("ray.serve.llm")
    deploy = schema.ServeDeploySchema.model_validate(_raw(name))
    assert deploy.http_options.host == "0.0.0.0"  # reachable from the serve Service
    (_, args), = load_serve_config(CONFIGS / f"{name}.yaml").ours()
    engine = llm.LLMConfig(**args.llm_config_dict()).get_engine_config()
    assert {"tool_call_parser", "enable_auto_tool_choice"} <= set(engine.frontend_kwargs)
    assert engine.engine_kwargs["tokenizer_mode"] == _flags(name)["tokenizer_mode"]
    assert len(engine.placement_bundles) == args.parallel().gpus_per_engine


# ------------------------------------------------------------------ DeepSeek-V4.1


@pytest.mark.parametrize("name", V41_PRESETS)
def test_v41_presets_declare_the_v41_stack_and_offer_dspark(name):
    """vLLM 0.30+ only (plan refuses 0.29); DSpark opt-in as a commented block."""
    (_, args), = load_serve_config(CONFIGS / f"{name}.yaml").ours()
    assert args.dsv4.vllm_version == "0.34.0"
    assert args.llm.model_loading_config.model_id == "deepseek-ai/DeepSeek-V4.1-Flash"
    assert "speculative_config" not in _engine(name)  # opt-in: not on by default
    text = (CONFIGS / f"{name}.yaml").read_text()
    assert re.search(r"^\s*# speculative_config: \{method: dspark", text, re.M)


def test_v41_presets_expect_each_gpu_types_own_record():
    expected = {name: load_serve_config(CONFIGS / f"{name}.yaml").ours()[0][1].dsv4
                for name in V41_PRESETS}
    assert expected["v41-flash-h200"].expected_layouts == {"sm90": "fp8_ds_mla"}
    assert expected["v41-flash-b200"].expected_layouts == {"sm100": "nvfp4_ds_mla"}
    mixed = expected["v41-flash-mixed"]
    assert mixed.expected_layouts == {"sm90": "fp8_ds_mla", "sm100": "nvfp4_ds_mla"}
    assert sorted(mixed.nodes()) == ["sm100", "sm90"]
    # a replica finds its type from its probed node (NodeInfo.as_dict: "10.0")
    assert mixed.expected_for({"platform": "cuda", "compute_capability": "10.0"}) == \
        "nvfp4_ds_mla"
    assert mixed.expected_for({"platform": "cuda", "compute_capability": "9.0"}) == \
        "fp8_ds_mla"


def test_node_types_that_do_not_fit_are_rejected(tmp_path):
    raw = _raw("v41-flash-mixed")
    dsv4 = raw["applications"][0]["args"]["dsv4"]
    dsv4["node_types"]["sm90"]["compute_capability"] = "10.0"
    _assert_rejected(raw, tmp_path, r"node_types.sm90.*is node type 'sm100'.*Fix")
    raw = _raw("v41-flash-mixed")
    raw["applications"][0]["args"]["dsv4"]["node_types"]["sm100"]["gpus_per_node"] = 4
    _assert_rejected(raw, tmp_path, r"node_types.sm100.gpus_per_node=4.*Fix")
