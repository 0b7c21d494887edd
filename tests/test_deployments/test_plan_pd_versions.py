"""``plan`` on P/D pools that each declare their vLLM (``pd.<pool>.vllm_version``).

NIXL_CONNECTOR_VERSION is part of NIXL's compatibility hash (15 in vLLM 0.33, 16 in 0.34):
pools of releases that differ in it never complete a handshake, so ``plan`` refuses them.
"""

from __future__ import annotations

import argparse
import copy
import logging
from pathlib import Path

import pytest
import yaml

from deployments.cli import plan as plan_cli
from deployments.config import ConfigError, parse_app_args
from deployments.plan import preflight

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def _pd_config(tmp_path: Path, prefill: str | None, decode: str | None,
               app: str | None = None, base: str = "flash-h200-pd") -> Path:
    raw = yaml.safe_load((CONFIGS / f"{base}.yaml").read_text())
    args = raw["applications"][0]["args"]
    args.setdefault("pd", {"kv_transfer_config": {"kv_connector": "NixlConnector"}})
    if app is not None:
        args["dsv4"]["vllm_version"] = app
    if args["llm"]["engine_kwargs"].get("data_parallel_size", 1) > 1:  # P/D: TP engines
        args["llm"]["engine_kwargs"].update(data_parallel_size=1, tensor_parallel_size=4)
    for pool, version in (("prefill", prefill), ("decode", decode)):
        if version is not None:
            args["pd"].setdefault(pool, {})["vllm_version"] = version
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(raw))
    (tmp_path / "models").symlink_to(CONFIGS / "models")  # the shipped model configs
    return path


def _plan(path: Path) -> preflight.ReplicaPlan:
    report = preflight.plan_config(path)
    assert len(report.applications) == 1
    return report.applications[0]


def _problem(plan: preflight.ReplicaPlan, code: str):
    found = [p for p in plan.problems if p.code == code]
    return found[0] if found else None


def test_pools_of_0_33_and_0_34_are_refused_naming_both(tmp_path, capsys):
    path = _pd_config(tmp_path, "0.33.0", "0.34.0")
    plan = _plan(path)
    problem = _problem(plan, "pd-nixl-version")
    assert problem is not None and problem.severity == "error"
    for text in ("prefill pool vLLM 0.33.0", "decode pool vLLM 0.34.0",
                 "NIXL_CONNECTOR_VERSION 15", "16", "Fix:", "pd.prefill.vllm_version"):
        assert text in problem.message
    assert plan.pd["pools"]["prefill"]["nixl_connector_version"] == 15
    assert plan.pd["pools"]["decode"]["nixl_connector_version"] == 16
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    assert plan_cli.main(parser.parse_args([str(path)])) == 1
    out = capsys.readouterr().out
    assert "REFUSED" in out and "0.33.0" in out and "0.34.0" in out


def test_a_pool_without_its_own_version_runs_the_apps(tmp_path, caplog):
    path = _pd_config(tmp_path, None, "0.34.0", app="0.33.0")
    ours = logging.getLogger("dsv4_serve.config")  # our family does not propagate to root
    ours.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="dsv4_serve.config"):
            plan = _plan(path)
    finally:
        ours.removeHandler(caplog.handler)
    problem = _problem(plan, "pd-nixl-version")
    assert problem is not None and problem.severity == "error"
    assert "prefill pool vLLM 0.33.0 (from the app)" in problem.message
    assert "decode pool vLLM 0.34.0 (from pd.decode.vllm_version)" in problem.message
    assert "pd.prefill.vllm_version unset" in caplog.text and "0.33.0" in caplog.text


def test_releases_with_one_connector_version_are_allowed_with_a_warning(tmp_path):
    # 0.23.0 and 0.25.1 both speak NIXL_CONNECTOR_VERSION 4.
    plan = _plan(_pd_config(tmp_path, "0.23.0", "0.25.1"))
    assert _problem(plan, "pd-nixl-version") is None
    warning = _problem(plan, "pd-vllm-differs")
    assert warning is not None and warning.severity == "warning"
    assert "NIXL_CONNECTOR_VERSION 4" in warning.message
    assert "requires equal vLLM versions" in warning.message  # what still happens at runtime


def test_neighbouring_releases_are_refused_on_their_own_connector_versions(tmp_path):
    plan = _plan(_pd_config(tmp_path, "0.31.0", "0.32.0"))
    problem = _problem(plan, "pd-nixl-version")
    assert problem is not None
    assert "vLLM 0.31.0 speaks NIXL_CONNECTOR_VERSION 13" in problem.message
    assert "vLLM 0.32.0 speaks 14" in problem.message


def test_one_release_in_both_pools_plans_cleanly(tmp_path):
    plan = _plan(_pd_config(tmp_path, "0.33.0", "0.33.0"))
    assert _problem(plan, "pd-nixl-version") is None
    assert _problem(plan, "pd-vllm-differs") is None
    rows = dict(plan_cli.table_rows(plan))
    assert rows["P/D vLLM"].startswith("prefill 0.33.0 (NIXL connector 15, from "
                                       "pd.prefill.vllm_version)")


def test_the_pools_replicas_see_their_own_release():
    raw = yaml.safe_load((CONFIGS / "flash-h200-pd.yaml").read_text())
    args = copy.deepcopy(raw["applications"][0]["args"])
    args["dsv4"]["vllm_version"] = "0.33.0"
    args["pd"]["decode"] = {"vllm_version": "0.34.0"}
    parsed = parse_app_args(args)
    assert parsed.pool_dsv4("decode")["vllm_version"] == "0.34.0"
    assert parsed.pool_dsv4("prefill")["vllm_version"] == "0.33.0"


def test_a_pool_version_that_is_not_a_release_is_refused():
    raw = yaml.safe_load((CONFIGS / "flash-h200-pd.yaml").read_text())
    args = copy.deepcopy(raw["applications"][0]["args"])
    args["pd"]["prefill"] = {"vllm_version": "latest"}
    with pytest.raises((ConfigError, ValueError), match="vllm_version"):
        parse_app_args(args)


def test_v41_pools_of_0_33_and_0_34_are_refused(tmp_path):
    plan = _plan(_pd_config(tmp_path, "0.33.0", "0.34.0", base="v41-flash-b200"))
    assert plan.family == "deepseek_v41"
    problem = _problem(plan, "pd-nixl-version")
    assert problem is not None and problem.severity == "error"


def test_v41_pools_are_predicted_by_their_own_release(tmp_path):
    """SM120 pools: vLLM 0.33 builds V4.1 with 128-token blocks, 0.34 with 64 (vllm#59203)."""
    path = _pd_config(tmp_path, "0.33.0", "0.34.0", base="v41-flash-b200")
    raw = yaml.safe_load(path.read_text())
    node = raw["applications"][0]["args"]["dsv4"]["node"]
    node.update(compute_capability="12.0", gpu_memory_gib=95.0)
    raw["applications"][0]["args"]["dsv4"].pop("expected_layout", None)
    raw["applications"][0]["args"]["dsv4"].pop("expected_layouts", None)
    path.write_text(yaml.safe_dump(raw))
    problem = _problem(_plan(path), "pd-node-record")
    assert problem is not None and problem.severity == "error", problem
    assert "on vLLM 0.33.0" in problem.message and "on vLLM 0.34.0" in problem.message
    assert "block_size: prefill 128, decode 64" in problem.message
