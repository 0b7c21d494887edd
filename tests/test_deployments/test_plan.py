"""``dsv4-serve plan``: numbers checked against hand-computed values.

The expected values below are worked out by hand from the published configs
(configs/models/) and the formulas in deployments/plan/capacity.py's docstring, so a
change to the weight model, the parallel split or the capacity formula shows up
as a concrete wrong number, not as a silently different table.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest
import yaml

from deployments.cli import plan as plan_cli
from deployments.config import ConfigError, parse_app_args
from deployments.plan import model_configs, preflight, weights

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
GIB = 2**30


def _plan(name: str, **kwargs) -> preflight.PlanReport:
    return preflight.plan_config(CONFIGS / f"{name}.yaml", **kwargs)


def _only(report: preflight.PlanReport) -> preflight.ReplicaPlan:
    assert len(report.applications) == 1
    return report.applications[0]


def _codes(p: preflight.ReplicaPlan) -> dict[str, str]:
    return {problem.code: problem.severity for problem in p.problems}


def _raw_args(name: str) -> dict:
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    return copy.deepcopy(raw["applications"][0]["args"])


def _model_cfg(model: str) -> dict:
    return json.loads((CONFIGS / "models" / "deepseek-ai" / model / "config.json").read_text())


# ------------------------------------------------------------------ weights


def test_flash_weight_estimate_matches_hand_count():
    # Routed experts 43 x 256 x 3 x 4096 x 2048 = 277,025,390,592 params in MXFP4
    # (17/32 B each) = 147,169,738,752 B; shared 43 x 3 x 4096 x 2048 FP8 (+1/16384
    # scale) = 1,082,196,480 B; attention wq_b+wo_a+wo_b 43 x 3 x 33,554,432 FP8 =
    # 4,328,785,920 B; replicated: FP8 fused wq_a/wkv + indexer wq_b 446,693,376
    # params -> 446,720,640 B, bf16 compressors/indexer/router 354,680,832 params
    # -> 709,361,664 B; embeddings + lm_head 2 x 129280 x 4096 bf16 = 2,118,123,520 B.
    w = weights.estimate_weights(_model_cfg("DeepSeek-V4-Flash"))
    assert w.routed_experts == 147_169_738_752
    assert w.shared_experts == 1_082_196_480
    assert w.tp_sharded == 4_328_785_920
    assert w.replicated == 446_720_640 + 709_361_664
    assert w.vocab == 2_118_123_520
    assert w.total == 155_854_926_976
    assert w.parameters == 284_296_478_720  # the published "284B" (router included)


def test_pro_weight_estimate_matches_published_size():
    w = weights.estimate_weights(_model_cfg("DeepSeek-V4-Pro"))
    assert w.total == pytest.approx(850_382_365_760)
    # ~865 GB on disk includes the MTP layer (one more MoE layer, ~13.5 GB MXFP4).
    assert 840e9 < w.total < 865e9
    assert 1.55e12 < w.parameters < 1.6e12


def test_unquantized_config_is_bf16():
    cfg = _model_cfg("DeepSeek-V4-Flash")
    cfg.pop("quantization_config")
    w = weights.estimate_weights(cfg)
    assert w.total == pytest.approx(2 * w.parameters)


# ------------------------------------------------------------------ presets


def test_flash_h200_dp8_hand_computed():
    p = _only(_plan("flash-h200"))
    cap = p.capacity
    assert (p.layout, p.engine_kv_cache_dtype, cap.storage) == ("fp8_ds_mla", "fp8", "fp8_ds_mla")
    assert cap.kv_bytes_per_token == 3915  # 21 x (146.25 + 33.75) + 20 x 6.75
    # DP8 + EP8, TP1: routed experts / 8, everything else on every GPU:
    # 147,169,738,752 / 8 + 1,082,196,480 + 4,328,785,920 + 2,118,123,520 + 1,156,082,304
    assert cap.weights_per_gpu_bytes == 27_081_405_568
    # 140.4 GiB x 0.95 - weights = 116,134,278,917.12 B; / 3915 B = 29,663,928.2
    assert cap.kv_tokens_per_engine == 29_663_928
    assert cap.kv_tokens_per_replica == 8 * 29_663_928  # 8 independent DP pools
    assert p.parallel["gpus_per_replica"] == 8 and p.parallel["expert_parallel_size"] == 8
    assert not p.refused


def test_pro_h200_2node_hand_computed():
    p = _only(_plan("pro-h200-2node"))
    cap = p.capacity
    assert cap.kv_bytes_per_token == 5609.25  # 30 x 180 + 31 x 6.75
    # PP2 splits 61 layers [31, 30] (vLLM get_pp_indices): stage 0 has 15 C4 and
    # 16 C128 layers = 15 x 180 + 16 x 6.75 = 2808 B per token on each of its GPUs.
    assert cap.kv_bytes_per_token_per_gpu == 2808
    # (routed/8 + (shared + attention + vocab)/8 + replicated) / 2 stages
    assert cap.weights_per_gpu_bytes == pytest.approx(54_545_602_316)
    # 140.4 GiB x 0.95 - 54,545,602,316 = 88,670,082,169.12 B; / 2808 = 31,577,664.6
    assert cap.kv_tokens_per_engine == 31_577_664
    assert cap.kv_tokens_per_replica == 31_577_664  # TP replicates: one pool per replica
    assert p.parallel["gpus_per_replica"] == 16 and p.parallel["nodes_per_replica"] == 2


def test_sm120_tp2_fits_with_a_replicated_pool():
    p = _only(_plan("flash-sm120"))
    assert p.backend == "FLASHINFER_MLA_SPARSE_DSV4" and p.layout == "fp8_ds_mla"
    cap = p.capacity
    assert cap.kv_tokens_per_engine == cap.kv_tokens_per_replica
    assert cap.kv_tokens_per_engine > p.max_model_len
    assert not p.refused


def test_dp8_vs_tp8_on_b200_matches_upstream_measurement():
    """vllm-project/vllm#51454 measured 7.7x the KV capacity for DP8 vs TP8 on 8xB200."""
    dp = _only(_plan("flash-b200")).capacity.kv_tokens_per_replica
    raw = _raw_args("flash-b200")
    raw["llm"]["engine_kwargs"].update(data_parallel_size=1, tensor_parallel_size=8,
                                       enable_expert_parallel=False)
    raw["llm"]["placement_group_config"]["bundles"] = [{"GPU": 1, "CPU": 8}] * 8
    tp_args = parse_app_args(raw)
    tp = preflight.plan_application("tp8", tp_args, _model_cfg("DeepSeek-V4-Flash"))
    ratio = dp / tp.capacity.kv_tokens_per_replica
    assert ratio == pytest.approx(7.675, abs=0.01)
    # plan prints the same counterfactual for every DP preset
    shown = _only(_plan("flash-b200")).tp_alternative
    assert shown is not None
    assert shown.kv_tokens_per_replica == tp.capacity.kv_tokens_per_replica
    assert _only(_plan("pro-h200-2node")).tp_alternative is None  # already TP


def test_flashinfer_rows_preset_is_refused_with_an_explanation():
    report = _plan("flash-b200-flashinfer-rows")
    p = _only(report)
    assert report.refused and p.refused
    assert (p.layout, p.capacity.storage, p.expected_layout) == (
        "plain_rows", "bf16_rows", "fp8_ds_mla")
    assert p.capacity.kv_bytes_per_token == 6250
    alt = p.fp8_ds_mla_capacity
    assert alt is not None and alt.kv_bytes_per_token == 3915
    change = p.capacity.kv_tokens_per_replica / alt.kv_tokens_per_replica - 1
    assert change == pytest.approx(3915 / 6250 - 1, abs=1e-6)  # -37.4%
    message = next(x.message for x in p.problems if x.code == "layout-contradicts-expectation")
    for needle in ("bf16_rows", "6250 B", "3915 B", "-37.4%", "Fix:"):
        assert needle in message


def test_stock_vllm_crash_is_reported_for_the_pinned_gpu_vllm_only():
    assert _codes(_only(_plan("flash-h200")))["stock-vllm-crash"] == "warning"
    fixed = _only(_plan("flash-h200", vllm_version="0.30.0"))
    assert "stock-vllm-crash" not in _codes(fixed)
    rows = _only(_plan("flash-b200-flashinfer-rows"))  # plain rows never asserted
    assert "stock-vllm-crash" not in _codes(rows)


def test_local_cpu_plan_uses_the_cpu_kv_space():
    p = _only(_plan("local-cpu"))
    assert p.vllm_version == "0.32.0" and p.layout == "fp8_ds_mla"
    assert p.capacity.kv_tokens_per_engine == int(GIB // p.capacity.kv_bytes_per_token)
    assert not p.problems


# ------------------------------------------------------------------ problems


def test_reserve_that_leaves_no_room_for_max_model_len_is_refused():
    p = _only(_plan("flash-sm120", reserve_gib=14.0))
    assert _codes(p)["max-model-len-does-not-fit"] == "error"
    assert p.capacity.kv_tokens_per_engine < 1_048_576


def test_weights_that_do_not_fit_are_refused():
    raw = _raw_args("flash-sm120")
    raw["llm"]["engine_kwargs"]["tensor_parallel_size"] = 1
    raw["llm"]["placement_group_config"]["bundles"] = [{"GPU": 1, "CPU": 8}]
    p = preflight.plan_application("tp1", parse_app_args(raw), _model_cfg("DeepSeek-V4-Flash"))
    assert _codes(p)["weights-do-not-fit"] == "error"
    assert _codes(p)["idle-gpus"] == "warning"
    assert p.capacity.kv_tokens_per_engine == 0


@pytest.mark.parametrize(("policy", "severity"), [("enforce", "error"), ("warn", "warning")])
def test_replica_override_that_changes_pages_disagrees(policy, severity):
    # A GPU preset: on CPU the config itself refuses block sizes other than 256.
    raw = yaml.safe_load((CONFIGS / "flash-sm120.yaml").read_text())["applications"][0]["args"]
    raw["dsv4"]["policy"] = policy
    raw["dsv4"]["replica_overrides"] = [{"rank": 1, "engine_kwargs": {"block_size": 128}}]
    cfg = model_configs.find_model_config(parse_app_args(raw), CONFIGS / "flash-sm120.yaml")
    p = preflight.plan_application("canary", parse_app_args(raw), cfg)
    assert _codes(p)["replicas-disagree"] == severity
    disagree = next(x for x in p.problems if x.code == "replicas-disagree")
    assert "block_size 128 vs 256" in disagree.message


def test_fleet_serving_one_model_with_two_layouts_disagrees():
    fp8 = _only(_plan("flash-b200"))
    raw = _raw_args("flash-b200-flashinfer-rows")
    raw["dsv4"]["expected_layout"] = "plain_rows"  # an all-rows deployment, on its own fine
    rows = preflight.plan_application("rows", parse_app_args(raw), _model_cfg("DeepSeek-V4-Flash"))
    assert not rows.refused
    problems = preflight.fleet_problems([fp8, rows])
    assert [p.code for p in problems] == ["replicas-disagree"]
    assert preflight.fleet_problems([fp8, fp8]) == []


def test_non_dsv4_model_config_names_the_missing_keys(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    with pytest.raises(ConfigError, match=r"lacks num_hidden_layers.*model_type='llama'"):
        preflight.plan_config(CONFIGS / "flash-h200.yaml", model_config=cfg)


def test_unknown_model_names_the_fix(tmp_path):
    raw = yaml.safe_load((CONFIGS / "flash-h200.yaml").read_text())
    raw["applications"][0]["args"]["llm"]["model_loading_config"]["model_source"] = "acme/x"
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="--model-config"):
        preflight.plan_config(path)


# ------------------------------------------------------------------ CLI


def _cli(config: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    return parser.parse_args([str(CONFIGS / config), *extra])


def test_cli_table_and_exit_status(capsys):
    assert plan_cli.main(_cli("flash-h200.yaml")) == 0
    out = capsys.readouterr().out
    assert "29,663,928" in out and "237,311,424" in out and "verdict: ok" in out
    assert plan_cli.main(_cli("flash-b200-flashinfer-rows.yaml")) == 1
    assert "REFUSED" in capsys.readouterr().out


def test_cli_json(capsys):
    assert plan_cli.main(_cli("pro-h200-2node.yaml", "--json")) == 0
    data = json.loads(capsys.readouterr().out)
    app = data["applications"][0]
    assert data["refused"] is False
    assert app["capacity"]["kv_tokens_per_engine"] == 31_577_664
    assert app["capacity"]["kv_bytes_per_token"] == 5609.25


def test_cli_invalid_config_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications: []\n")
    args = argparse.Namespace(config=bad, json=False, model_config=None, vllm_version=None,
                              reserve_gib=0.0)
    assert plan_cli.main(args) == 2
    assert "applications" in capsys.readouterr().err


def test_dsv4_serve_cli_dispatches_plan(capsys):
    from deployments.cli import main as cli

    assert cli.main(["plan", str(CONFIGS / "flash-sm120.yaml")]) == 0
    assert "KV tokens/engine" in capsys.readouterr().out
    assert cli.main(["plan", "--json", str(CONFIGS / "flash-b200-flashinfer-rows.yaml")]) == 1
    assert json.loads(capsys.readouterr().out)["refused"] is True


def test_policy_problems_are_planned_not_raised(tmp_path):
    """A config the loader refuses is still planned; the planner names the problem."""
    raw = yaml.safe_load((CONFIGS / "flash-h200.yaml").read_text())
    raw["applications"][0]["args"]["llm"]["engine_kwargs"]["enable_expert_parallel"] = False
    path = tmp_path / "dp-no-ep.yaml"
    path.write_text(yaml.safe_dump(raw))
    model = CONFIGS / "models" / "deepseek-ai" / "DeepSeek-V4-Flash" / "config.json"
    report = preflight.plan_config(path, model_config=model)
    assert report.refused and "dp-without-ep" in _codes(_only(report))


# ------------------------------------------------------------------ DeepSeek-V4.1

V41_PRESETS = ("v41-flash-h200", "v41-flash-b200", "v41-flash-mixed")
# V4.1-Flash weights per GPU under DP8 + EP8 (weights.estimate_weights of the reconstructed
# config): routed 171,127,603,200 / 8 + attention 4,697,907,200 + vocab 2,647,654,400
# + replicated 660,625,280.
V41_WEIGHTS_PER_GPU = 29_397_137_280


@pytest.mark.parametrize("name", V41_PRESETS)
def test_v41_presets_plan_cleanly_on_their_declared_stack(name, capsys):
    """dsv4.vllm_version 0.34.0: no --vllm-version needed, no warning left behind."""
    report = _plan(name)
    assert not report.refused and report.problems == []
    p = _only(report)
    assert (p.family, p.vllm_version) == ("deepseek_v41", "0.34.0")
    assert p.problems == []  # the old v41-capacity warning is gone: the numbers are V4.1's
    assert plan_cli.main(_cli(f"{name}.yaml")) == 0
    assert "verdict: ok" in capsys.readouterr().out


def test_v41_h200_uses_the_v41_byte_model_hand_computed():
    # SM90: 584 B records in 576 B pages, block 64. Per KV source (layers 2, 8, 14: ratio 2;
    # 20: ratio 1): main round_up(32 x 584, 576) / 64 = 297 and indexer round_up(32 x 132,
    # 576) / 64 = 72 at ratio 2; 37,440 / 64 = 585 and 8,640 / 64 = 135 at ratio 1:
    # 3 x (297 + 72) + 585 + 135 = 1827 (V4's formula would say 5265).
    p = _only(_plan("v41-flash-h200"))
    cap = p.capacity
    assert (p.layout, p.cache_dtype_str, p.block_size) == ("fp8_ds_mla", "fp8_ds_mla", 64)
    assert p.backend == "FLASHMLA_SPARSE_DSV41"
    assert cap.kv_bytes_per_token == 1827
    assert cap.weights_per_gpu_bytes == V41_WEIGHTS_PER_GPU
    # 140.4 GiB x 0.95 - weights = 113,818,547,205.12 B; / 1827 = 62,298,055.4
    assert cap.kv_tokens_per_engine == 62_298_055
    assert cap.kv_tokens_per_replica == 8 * 62_298_055


def test_v41_b200_defaults_to_nvfp4_hand_computed():
    # SM100 mega: nvfp4_ds_mla, 288 B compressed records, 512 B pages, block 128: main
    # 64 x 288 / 128 = 144 and indexer round_up(64 x 132, 512) / 128 = 68 at ratio 2;
    # 288 and 132 at ratio 1: 3 x (144 + 68) + 288 + 132 = 1056.
    p = _only(_plan("v41-flash-b200"))
    cap = p.capacity
    assert (p.layout, p.block_size, p.backend) == ("nvfp4_ds_mla", 128,
                                                   "FLASHMLA_MEGA_ATTN_DSV41")
    assert cap.kv_bytes_per_token == 1056
    # 179.06 GiB x 0.95 - weights = 153,253,863,175.17 B; / 1056 = 145,126,764.4
    assert cap.kv_tokens_per_engine == 145_126_764


def test_mixed_plan_names_both_node_types_capacities_and_the_mix(capsys):
    p = _only(_plan("v41-flash-mixed"))
    by_type = {n.node_type: n for n in p.node_capacities}
    assert sorted(by_type) == ["sm100", "sm90"]
    assert (by_type["sm90"].layout, by_type["sm90"].capacity.kv_bytes_per_token) == (
        "fp8_ds_mla", 1827)
    assert (by_type["sm100"].layout, by_type["sm100"].capacity.kv_bytes_per_token) == (
        "nvfp4_ds_mla", 1056)
    assert by_type["sm90"].capacity.kv_tokens_per_replica == 8 * 62_298_055
    assert by_type["sm100"].capacity.kv_tokens_per_replica == 8 * 145_126_764
    sm100 = p.mix["node_types"][1]
    assert p.mix["reference"] == "sm90" and p.mix["groups"] == 2
    assert sm100["bytes_per_token_ratio"] == pytest.approx(1056 / 1827)
    assert sm100["tokens_per_replica_ratio"] == pytest.approx(145_126_764 / 62_298_055)
    assert plan_cli.main(_cli("v41-flash-mixed.yaml")) == 0
    out = capsys.readouterr().out
    assert "node type sm90" in out and "498,384,440 tokens/replica" in out
    assert "node type sm100" in out and "1,161,014,112 tokens/replica" in out
    assert "sm100/sm90: 0.58x bytes per token, 2.33x tokens per replica" in out
    assert plan_cli.main(_cli("v41-flash-mixed.yaml", "--json")) == 0
    data = json.loads(capsys.readouterr().out)["applications"][0]
    assert [n["node_type"] for n in data["node_capacities"]] == ["sm90", "sm100"]


def test_v41_preset_on_the_029_stack_is_refused():
    p = _only(_plan("v41-flash-h200", vllm_version="0.29.0"))
    assert _codes(p)["v41-needs-vllm-030"] == "error" and p.refused


def test_v41_node_type_contradicting_its_expectation_is_refused(tmp_path):
    raw = yaml.safe_load((CONFIGS / "v41-flash-mixed.yaml").read_text())
    raw["applications"][0]["args"]["dsv4"]["expected_layouts"]["sm100"] = "fp8_ds_mla"
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(raw))
    model = CONFIGS / "models" / "deepseek-ai" / "DeepSeek-V4.1-Flash" / "config.json"
    p = _only(preflight.plan_config(path, model_config=model))
    [problem] = [q for q in p.problems if q.code == "layout-contradicts-expectation"]
    assert "sm100" in problem.message and "nvfp4_ds_mla" in problem.message
    assert "expected_layouts: {sm100: nvfp4_ds_mla}" in problem.message


# ------------------------------------------------------- V4.1 per release, node, engine


def _v41_variant(tmp_path, node=None, engine=None, version=None, model=None):
    """v41-flash-b200 with one node / engine / release change, planned."""
    raw = yaml.safe_load((CONFIGS / "v41-flash-b200.yaml").read_text())
    args = raw["applications"][0]["args"]
    args["dsv4"].pop("expected_layouts", None)
    args["dsv4"].pop("expected_layout", None)
    args["dsv4"]["node"].update(node or {})
    ek = args["llm"]["engine_kwargs"]
    ek.update(engine or {})
    for key in [k for k, v in ek.items() if v is None]:
        del ek[key]
    if version:
        args["dsv4"]["vllm_version"] = version
    path = tmp_path / "v41.yaml"
    path.write_text(yaml.safe_dump(raw))
    model_path = CONFIGS / "models" / "deepseek-ai" / "DeepSeek-V4.1-Flash" / "config.json"
    if model is not None:
        model_path = tmp_path / "config.json"
        model_path.write_text(json.dumps(model))
    return _only(preflight.plan_config(path, model_config=model_path))


def test_the_shipped_v41_config_is_nested_and_plans_like_its_flat_form(tmp_path):
    nested = _model_cfg("DeepSeek-V4.1-Flash")
    assert "text_config" in nested and "vision_config" in nested
    flat = {k: v for k, v in nested.items() if k not in ("text_config", "vision_config")}
    flat.update({k: v for k, v in nested["text_config"].items() if k != "model_type"})
    a, b = _v41_variant(tmp_path), _v41_variant(tmp_path, model=flat)
    assert (a.cache_dtype_str, a.block_size, a.capacity.kv_bytes_per_token) == \
        (b.cache_dtype_str, b.block_size, b.capacity.kv_bytes_per_token) == \
        ("nvfp4_ds_mla", 128, 1056)


@pytest.mark.parametrize(("node", "engine", "version", "want"), [
    # ROCm: V4 record, block 64 (the indexer's family-9 size), vLLM's backend name.
    ({"platform": "rocm", "compute_capability": None}, {}, "0.33.0",
     ("ROCM_FLASHMLA_SPARSE_DSV41", "fp8_ds_mla", 64, 1827)),
    ({"platform": "rocm", "compute_capability": None}, {}, "0.32.0",
     ("ROCM_FLASHMLA_SPARSE_DSV4", "fp8_ds_mla", 64, 1827)),
    # SM120: block 128 on 0.33, 64 on 0.34 (vllm#59203).
    ({"compute_capability": "12.0"}, {}, "0.33.0",
     ("FLASHINFER_MLA_SPARSE_DSV41", "fp8_ds_mla", 128, 1800)),
    ({"compute_capability": "12.0"}, {}, "0.34.0",
     ("FLASHINFER_MLA_SPARSE_DSV41", "fp8_ds_mla", 64, 1827)),
    # TP16 leaves 4 heads per wo_a group: FlashMLA, 528 B compressed records.
    ({}, {"tensor_parallel_size": 16, "data_parallel_size": 1}, "0.34.0",
     ("FLASHMLA_SPARSE_DSV41", "fp8_ds_mla", 128, 1656)),
    # LoRA turns mega off on 0.34 only.
    ({}, {"enable_lora": True}, "0.34.0", ("FLASHMLA_SPARSE_DSV41", "fp8_ds_mla", 128, 1656)),
    ({}, {"enable_lora": True}, "0.33.0",
     ("FLASHMLA_MEGA_ATTN_DSV41", "nvfp4_ds_mla", 128, 1056)),
    # vLLM 0.30 has no mega attention.
    ({}, {}, "0.30.0", ("FLASHMLA_SPARSE_DSV41", "fp8_ds_mla", 128, 1656)),
])
def test_v41_plan_is_what_the_release_builds(tmp_path, node, engine, version, want):
    p = _v41_variant(tmp_path, node, engine, version)
    assert (p.backend, p.cache_dtype_str, p.block_size, p.capacity.kv_bytes_per_token) == want


def test_v41_plan_with_other_head_groups_rules_mega_out(tmp_path):
    model = _model_cfg("DeepSeek-V4.1-Flash")
    model["text_config"]["o_groups"] = 16
    p = _v41_variant(tmp_path, version="0.34.0", model=model)
    assert (p.backend, p.cache_dtype_str) == ("FLASHMLA_SPARSE_DSV41", "fp8_ds_mla")


def test_v41_block_size_no_backend_accepts_is_refused(tmp_path):
    p = _v41_variant(tmp_path, engine={"block_size": 64}, version="0.34.0")
    assert p.refused and "block_size=64" in " ".join(q.message for q in p.problems)


def test_unset_gpu_memory_utilization_is_the_releases_default(tmp_path):
    """0.34 sizes with 1.0 under the extensible KV cache (on by default on CUDA), earlier
    releases with 0.92 (config/cache.py of each wheel)."""
    budgets = {}
    for version in ("0.33.0", "0.34.0"):
        p = _v41_variant(tmp_path, engine={"gpu_memory_utilization": None}, version=version)
        budgets[version] = p.capacity.kv_budget_per_gpu_bytes + p.capacity.weights_per_gpu_bytes
    gib = 179.06 * 2**30
    assert budgets["0.33.0"] == pytest.approx(gib * 0.92)
    assert budgets["0.34.0"] == pytest.approx(gib * 1.0)
