"""The P/D compatibility check and the P/D config: pure, no Ray, no engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, cast

import pytest

from deployments.config import ConfigError, PDAppArgs, load_serve_config, parse_app_args
from deployments.control.wire import PDVerdict, ReplicaSpec, State, TransferSpec
from deployments.harness.standin import standin_spec
from deployments.pd import compat
from dsv4_patch.tiny_model import ensure_tiny_model

REPO = Path(__file__).resolve().parents[2]
PD_CONFIG = REPO / "configs" / "local-cpu-pd.yaml"


def transfer(pool: str, **changes: Any) -> TransferSpec:
    base = {"pool": pool, "model_hash": "sha256:abc", "model_files": ["config.json"],
            "model_path": "/models/a", "connector": "NixlConnector", "connector_version": 14,
            "kv_role": "kv_producer" if pool == "prefill" else "kv_consumer",
            "transfer_mode": "pull", "backend_names": ["CPU_DSV4"],
            "kv_cache_layout": "NHD", "kernel_block_size": 256,
            "region_block_lens": [37440, 8640, 37440]}
    return TransferSpec.model_validate(base | changes)


def replica(rid: str, pool: str, *, reordered: bool = False, vllm: str | None = None,
            **changes: Any) -> ReplicaSpec:
    spec = standin_spec(rid, 0, reordered=reordered)
    versions = spec.versions | ({"vllm": vllm} if vllm else {})
    return spec.model_copy(update={"transfer": transfer(pool, **changes),
                                   "versions": versions})


def test_identical_pools_are_compatible_and_every_pair_is_allowed() -> None:
    prefill = [replica("p0", "prefill"), replica("p1", "prefill")]
    decode = [replica("d0", "decode")]
    report = compat.judge(prefill, decode, {})
    assert report.verdict is PDVerdict.COMPATIBLE and report.differences == []
    assert report.allowed == {"d0": ["p0", "p1"]} and report.blocked_prefill == []


def test_the_model_path_string_does_not_matter_its_content_does() -> None:
    """NIXL's hash differs for a copy at another path; ours compares content."""
    prefill = [replica("p0", "prefill", model_path="/models/a", nixl_compat_hash="h1")]
    decode = [replica("d0", "decode", model_path="/mnt/copy", nixl_compat_hash="h2")]
    assert compat.judge(prefill, decode, {}).verdict is PDVerdict.COMPATIBLE
    other = [replica("d0", "decode", model_hash="sha256:other")]
    report = compat.judge(prefill, other, {})
    assert report.verdict is PDVerdict.INCOMPATIBLE
    assert [d.field for d in report.differences] == ["model_hash"]


@pytest.mark.parametrize(("field", "changes"), [
    ("region_block_lens", {"region_block_lens": [37440, 8640, 74880]}),
    ("kernel_block_size", {"kernel_block_size": 128}),
    ("backend_names", {"backend_names": ["FLASHMLA"]}),
    ("connector_version", {"connector_version": 13}),
    ("transfer_mode", {"transfer_mode": "push"}),
    ("kv_cache_layout", {"kv_cache_layout": "HND"}),
])
def test_each_transfer_field_is_compared_and_named(field: str, changes: dict[str, Any]) -> None:
    report = compat.judge([replica("p0", "prefill")], [replica("d0", "decode", **changes)],
                             {})
    assert report.verdict is PDVerdict.INCOMPATIBLE
    assert [d.field for d in report.differences] == [field]
    assert field in report.message and "p0" in report.message and "d0" in report.message


def test_a_layer_mix_difference_names_the_layers() -> None:
    report = compat.judge([replica("p0", "prefill")],
                             [replica("d0", "decode", reordered=True)], {})
    [diff] = report.differences
    assert diff.field == "fingerprint"
    assert {d.layer for d in diff.layers} >= {"model.layers.2.attn", "model.layers.3.attn"}


def test_vllm_version_and_unknown_identity_are_differences() -> None:
    report = compat.judge([replica("p0", "prefill", vllm="0.32.0")],
                             [replica("d0", "decode", vllm="0.31.0")], {})
    assert [d.field for d in report.differences] == ["vllm_version"]
    unknown = compat.judge([replica("p0", "prefill", model_hash=None)],
                              [replica("d0", "decode", model_hash=None)], {})
    assert [d.field for d in unknown.differences] == ["model_hash"]


def test_pools_of_releases_with_other_nixl_versions_name_both() -> None:
    """0.33 speaks NIXL_CONNECTOR_VERSION 15, 0.34 speaks 16 (their nixl/metadata.py): the
    handshake hash differs, so such pools never transfer; the refusal names both."""
    report = compat.judge([replica("p0", "prefill", vllm="0.33.0")],
                          [replica("d0", "decode", vllm="0.34.0")], {})
    [diff] = report.differences
    text = compat.describe(diff)
    assert "NIXL_CONNECTOR_VERSION 15" in text and "vLLM 0.34.0 speaks 16" in text
    same = compat.describe(compat.judge([replica("p0", "prefill", vllm="0.31.0")],
                                        [replica("d0", "decode", vllm="0.31.1")],
                                        {}).differences[0])
    assert "NIXL" not in same  # same connector version: the release differs, the hash not


def test_roles_and_a_missing_transfer_spec_are_differences() -> None:
    report = compat.judge([replica("p0", "prefill", kv_role="kv_consumer")],
                             [replica("d0", "decode")], {})
    assert [d.field for d in report.differences] == ["kv_role"]
    bare = standin_spec("d0", 0)
    assert [d.field for d in compat.compare(replica("p0", "prefill"), bare)] == ["transfer"]


def test_one_odd_prefill_is_routed_around() -> None:
    prefill = [replica("p0", "prefill"), replica("p1", "prefill", kernel_block_size=64)]
    report = compat.judge(prefill, [replica("d0", "decode"), replica("d1", "decode")], {})
    assert report.verdict is PDVerdict.PARTIAL
    assert report.allowed == {"d0": ["p0"], "d1": ["p0"]} and report.blocked_prefill == ["p1"]


def test_no_answers_yet_means_no_transfers() -> None:
    report = compat.judge([], [replica("d0", "decode")], {})
    assert report.verdict is PDVerdict.NOT_CHECKED and report.allowed == {}
    assert compat.combined_state(State.AGREE, report.verdict) is State.NOT_CHECKED
    assert compat.combined_state(State.AGREE, PDVerdict.PARTIAL) is State.DISAGREE
    assert compat.pool_state([State.AGREE, State.INCOMPLETE]) is State.INCOMPLETE


def test_model_identity_is_by_content(tmp_path: Path) -> None:
    tiny = ensure_tiny_model()
    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    digest, files = compat.model_identity(tiny)
    assert digest is not None and "config.json" in files and "tokenizer.json" in files
    assert compat.model_identity(copy) == (digest, files)
    (copy / "tokenizer_config.json").write_text("{}")
    assert compat.model_identity(copy)[0] != digest
    assert compat.model_identity(tmp_path / "nowhere") == (None, [])


# ------------------------------------------------------------------ config


def pd_args(**pd: Any) -> dict[str, Any]:
    [(_, args)] = load_serve_config(PD_CONFIG).ours()
    raw = args.model_dump(mode="json", exclude_none=True)
    raw["pd"] = raw["pd"] | pd
    return raw


def test_the_cpu_pd_config_builds_two_pools() -> None:
    [(_, args)] = load_serve_config(PD_CONFIG).ours()
    assert type(args).__name__ == "PDAppArgs" and args.max_replicas_total == 2
    pd = cast(PDAppArgs, args)  # asserted just above
    prefill = pd.pool_llm_config_dict("prefill", "/m")
    decode = pd.pool_llm_config_dict("decode", "/m")
    assert prefill["engine_kwargs"]["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert decode["engine_kwargs"]["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert prefill["runtime_env"]["env_vars"]["UCX_TLS"] == "tcp,self,sm"


def test_handshake_hash_off_is_refused_without_our_check() -> None:
    off = {"kv_connector": "NixlConnector",
           "kv_connector_extra_config": {"enforce_handshake_compat": False}}
    with pytest.raises(ConfigError, match=r"enforce_handshake_compat=false with "
                       r"pd.compat_check=false.*Fix: set pd.compat_check: true"):
        parse_app_args(pd_args(kv_transfer_config=off, compat_check=False))
    parse_app_args(pd_args(kv_transfer_config=off, compat_check=True))  # ours covers it


def test_connectors_without_hybrid_kv_support_and_roles_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"kv_connector='ExampleConnector'.*NixlConnector"):
        parse_app_args(pd_args(kv_transfer_config={"kv_connector": "ExampleConnector"}))
    with pytest.raises(ConfigError, match=r"kv_role='kv_both'.*remove kv_role"):
        parse_app_args(pd_args(kv_transfer_config={"kv_connector": "NixlConnector",
                                                   "kv_role": "kv_both"}))
    with pytest.raises(ConfigError, match=r"replica_overrides\[0\].rank=1.*at most 1"):
        parse_app_args(pd_args(decode={"replica_overrides": [
            {"rank": 1, "engine_kwargs": {"hf_overrides": {}}}]}))


# ------------------------------------------------------------------ routing, status, plan


def test_the_decode_whitelist_is_empty_until_checked_and_then_exact() -> None:
    from deployments.control.wire import PDRouteMessage
    from deployments.pd import route as pd_route

    route = pd_route.Route()
    assert not route.may_transfer() and not route.permits("p0")  # not checked: no transfer
    saved = pd_route.ROUTE
    try:
        pd_route.ROUTE = route
        message = PDRouteMessage(checked_at=1.0, verdict=PDVerdict.PARTIAL,
                                 allowed={"d0": ["p0"], "d1": []})
        taken = pd_route.take(message, "d0")
        assert taken.may_transfer() and taken.permits("p0") and not taken.permits("p1")
        assert pd_route.live_route() is route
        assert not pd_route.take(message, "d1").may_transfer()  # stranded: prefill locally
    finally:
        pd_route.ROUTE = saved
    assert pd_route.Route(check=False).permits("anything")


def test_status_and_plan_show_the_pools_and_the_verdict() -> None:
    from deployments.control.report import describe
    from deployments.control.wire import Expected, FleetReport, PDPool
    from deployments.plan import pd as pd_plan

    prefill = [replica("p0", "prefill"), replica("p1", "prefill", kernel_block_size=64)]
    pools = {"prefill": PDPool(deployment="Prefill:m", state=State.AGREE, replicas=["p0", "p1"]),
             "decode": PDPool(deployment="Decode:m", state=State.AGREE, replicas=["d0"])}
    pd = compat.judge(prefill, [replica("d0", "decode")], pools)
    report = FleetReport(state=State.DISAGREE, agree=False, policy="enforce",
                         expected=Expected(layout="fp8_ds_mla", reference="prediction"), pd=pd)
    text = describe(report)
    assert "P/D: partial" in text and "decode d0 takes KV from prefill ['p0']" in text
    [(_, args)] = load_serve_config(PD_CONFIG).ours()
    summary = pd_plan.summary(args, 3915.0, 256, 1000, 2048, "0.29.0")
    assert summary["bytes_moved_per_request"] == {"1024": 1024 * 3915, "2048": 2048 * 3915}
    rows = dict(pd_plan.rows(summary))
    assert "NixlConnector" in rows["P/D connector"] and "prefill 1 x 1,000" in rows["P/D pools"]
    assert rows["P/D vLLM"] == ("prefill 0.29.0 (NIXL connector 9, from the app), "
                                "decode 0.29.0 (NIXL connector 9, from the app)")


# ------------------------------------------------ P/D across GPU types (DeepSeek-V4.1)

_REPO = Path(__file__).resolve().parents[2]
_MODELS = _REPO / "configs" / "models" / "deepseek-ai"
_H200 = {"platform": "cuda", "compute_capability": [9, 0], "attention_backend": None}
_B200 = {"platform": "cuda", "compute_capability": [10, 0], "attention_backend": None}


def test_v41_sm90_prefill_and_sm100_decode_pools_differ_by_name() -> None:
    from tests.support.rule_contracts import pool_node_differences

    cfg = json.loads((_MODELS / "DeepSeek-V4.1-Flash" / "config.json").read_text())
    diffs = {f: (p, d) for f, p, d in pool_node_differences(cfg, _H200, _B200, "auto",
                                                            "0.33.0")}
    assert diffs["cache_dtype_str"] == ("fp8_ds_mla", "nvfp4_ds_mla")
    assert diffs["swa_record_bytes"] == (584, 528)
    assert diffs["page_alignment"] == (576, 512)
    assert diffs["block_size"] == (64, 128)
    assert diffs["kv_bytes_per_token"] == (1827, 1056)
    flashmla = _B200 | {"attention_backend": "FLASHMLA_SPARSE_DSV41"}
    same_name = {f for f, _, _ in pool_node_differences(cfg, _H200, flashmla, "auto")}
    assert "cache_dtype_str" not in same_name  # one dtype name, other bytes:
    assert {"swa_record_bytes", "page_alignment", "kv_bytes_per_token"} <= same_name


def test_v4_pools_on_sm90_and_sm100_flashmla_agree() -> None:
    from tests.support.rule_contracts import pool_node_differences

    cfg = json.loads((_MODELS / "DeepSeek-V4-Flash" / "config.json").read_text())
    assert pool_node_differences(cfg, _H200, _B200, "auto", "0.33.0") == []
    rows = _B200 | {"attention_backend": "FLASHINFER_MLA_SPARSE_DSV4"}
    assert pool_node_differences(cfg, _H200, rows, "auto", "0.33.0")


def test_plan_refuses_v41_pd_across_gpu_types_and_v41_on_the_029_stack(
        tmp_path: Path) -> None:
    import yaml

    from deployments.plan import preflight

    raw = yaml.safe_load((_REPO / "configs" / "flash-h200-pd.yaml").read_text())
    args = raw["applications"][0]["args"]
    args["llm"]["model_loading_config"] = {"model_id": "deepseek-ai/DeepSeek-V4.1-Flash",
                                           "model_source": "deepseek-ai/DeepSeek-V4.1-Flash"}
    args["llm"]["engine_kwargs"].pop("block_size", None)
    args["pd"]["decode"] = {"node": {"platform": "cuda", "compute_capability": "10.0",
                                     "gpus_per_node": 8, "gpu_memory_gib": 178.4}}
    path = tmp_path / "v41-pd.yaml"
    path.write_text(yaml.safe_dump(raw))
    model = _MODELS / "DeepSeek-V4.1-Flash" / "config.json"
    plan = preflight.plan_config(path, model_config=model, vllm_version="0.33.0")
    problems = {p.code: p for p in plan.applications[0].problems}
    assert problems["pd-node-record"].severity == "error"
    text = problems["pd-node-record"].message
    assert "swa_record_bytes: prefill 584, decode 528" in text and "Fix:" in text
    old = preflight.plan_config(path, model_config=model, vllm_version="0.29.0")
    problems = {p.code: p for p in old.applications[0].problems}
    assert "gpu-v41" in problems["v41-needs-vllm-030"].message
