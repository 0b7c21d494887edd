"""The P/D output canary's rules, without engines: prompt, verdict, whitelist gate, pin,
the load-failure policy, and the vllm#57661 warning per release (plan and doctor).

The canary on real engines with injected faults: tests/test_deployments/test_pd_canary.py
(``make test-pd``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import yaml

from deployments.config import ConfigError, parse_app_args
from deployments.config.pd import PDAppArgs
from deployments.control.canary_wire import CanaryBatch, CanaryMode, CanaryResult
from deployments.control.wire import PDReport, PDVerdict
from deployments.pd import canary
from deployments.pd import route as pd_route
from deployments.pd.canary_watch import CanaryWatch
from deployments.plan import pd as pd_plan
from deployments.plan import preflight
from dsv4_patch import doctor, rules
from dsv4_patch.node import NodeInfo

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


# ------------------------------------------------------------------------ prompt, rules

def test_each_seed_draws_its_own_prompt_of_ordinary_tokens() -> None:
    a, b = canary.prompt(1, 699, 1000), canary.prompt(2, 699, 1000)
    assert a == canary.prompt(1, 699, 1000) and a != b and len(a) == 699
    assert min(a + b) >= canary.FIRST_ID and max(a + b) < 1000
    with pytest.raises(ValueError, match="vocab_size=10"):
        canary.prompt(1, 10, 10)


@pytest.mark.parametrize(("requested", "max_len", "expected"),
                         [(700, 2048, 700), (768, 2048, 767), (700, 512, 503)])
def test_the_prompt_ends_inside_a_block_and_fits_the_context(requested: int, max_len: int,
                                                             expected: int) -> None:
    assert canary.prompt_length(requested, max_len, 8) == expected


def test_stock_dummy_weights_get_a_transfer_only_canary_that_says_why() -> None:
    mode, why = canary.mode("dummy", {})
    assert mode is CanaryMode.TRANSFER_ONLY and "context" in why
    assert canary.mode("dummy", {canary.SCALED_WEIGHTS_ENV: "1"}) == (CanaryMode.OUTPUT, "")
    assert canary.mode("auto", {}) == (CanaryMode.OUTPUT, "")


def test_tolerance_per_platform_and_configured() -> None:
    assert canary.tolerance("cpu", None) == 1.0
    assert canary.tolerance("cuda", None) == 1.5  # upstream's P/D consistency test
    assert canary.tolerance("cpu", 0.2) == 0.2


def test_median_tolerance_per_platform_and_configured() -> None:
    assert canary.median_tolerance("cpu", None) == 0.1
    assert canary.median_tolerance("cuda", None) is None  # not measured: not judged
    assert canary.median_tolerance("cuda", 0.05) == 0.05


# Per-token deltas measured on AVX2 (benchmarks/results/pd_canary_runs/): clean
# canaries with a MoE near tie on one or two tokens, and a row truncated to its named
# layer's page whose largest token stayed under the 1.0 max tolerance.
CLEAN_NEAR_TIES = [[0.0, 0.353, 0.0, 0.0, 0.185, 0.0, 0.001, 0.017],
                   [0.016, 0.0, 0.001, 0.014, 0.563, 0.014, 0.015, 0.014],
                   [0.017, 0.015, 0.225, 0.001, 0.015, 0.0, 0.001, 0.172]]
TRUNCATED_UNDER_MAX = [0.625, 0.371, 0.4, 0.195, 0.483, 0.96, 0.004, 0.03]


@pytest.mark.parametrize("deltas", CLEAN_NEAR_TIES)
def test_near_ties_on_a_few_tokens_pass_the_median(deltas: list[float]) -> None:
    assert _judge(max_tokens=8, tokens=list(range(8)), token_deltas=deltas,
                  tolerance_nats=1.0, median_tolerance_nats=0.1) == ""


def test_a_truncation_under_the_max_fails_by_the_median() -> None:
    args: dict[str, Any] = dict(max_tokens=8, tokens=list(range(8)),
                                token_deltas=TRUNCATED_UNDER_MAX, tolerance_nats=1.0)
    assert _judge(**args) == ""  # the max rule alone lets it through
    why = _judge(**args, median_tolerance_nats=0.1)
    assert "median decoded token's logprob is off by 0.386" in why and "0.96" in why


def _judge(**changes: Any) -> str:
    base: dict[str, Any] = dict(canary_mode=CanaryMode.OUTPUT, prompt_tokens=700,
                                max_tokens=4, tokens=[5, 6, 7, 8],
                                token_deltas=[0.0, 0.01, 0.0, 0.02], tolerance_nats=0.5,
                                external_tokens=512, finish_reason="length")
    return canary.judge(**(base | changes))


def test_a_clean_canary_passes() -> None:
    assert _judge() == ""


@pytest.mark.parametrize(("changes", "words"), [
    ({"finish_reason": "error"}, "failed KV receive"),
    ({"tokens": [5, 6]}, "2 of 4"),
    ({"external_tokens": 0}, "only 0 of 700"),
    ({"external_tokens": None}, "only None of 700"),
    ({"token_deltas": [0.0, 2.0, 0.0, 0.0]}, "token 1 (6) has logprob off by 2.000"),
])
def test_each_failure_is_named(changes: dict[str, Any], words: str) -> None:
    assert words in _judge(**changes)


def test_a_transfer_only_canary_ignores_logprobs_but_not_the_transfer() -> None:
    assert _judge(canary_mode=CanaryMode.TRANSFER_ONLY, token_deltas=[9.0] * 4) == ""
    assert "only 3" in _judge(canary_mode=CanaryMode.TRANSFER_ONLY, external_tokens=3)


def test_a_nan_logprob_fails_and_stays_valid_json() -> None:
    """Seen on CPU with replayed transfer params: the pair's logprobs were NaN, and
    NaN > tolerance is False, so the canary passed until NaN became NOT_FINITE."""
    got = canary.deltas([float("nan"), -1.0, float("-inf")], [-1.0, -1.0, -2.0])
    assert got == [canary.NOT_FINITE, 0.0, canary.NOT_FINITE]
    assert "NaN or infinite" in _judge(token_deltas=[0.0, canary.NOT_FINITE, 0.0, 0.0])
    assert "NaN or infinite" in _judge(token_deltas=[float("nan")] * 4)
    assert "NaN or infinite" in _judge(token_deltas=[0.0, float("nan"), 0.0, 0.0])


def test_deltas_are_per_token_and_lengths_must_match() -> None:
    assert canary.deltas([-1.0, -2.0], [-1.5, -2.0]) == [0.5, 0.0]
    with pytest.raises(ValueError):
        canary.deltas([-1.0], [-1.0, -2.0])


def test_the_local_reference_scores_the_pairs_tokens_while_both_pick_the_same() -> None:
    ref = [{5: -0.1, 6: -2.0}, {7: -0.3, 8: -1.5}, {9: -0.2}]
    assert canary.match_reference([5, 7, 9], [-0.1, -0.5, -0.2], ref) == \
        pytest.approx([0.0, 0.2, 0.0])
    # a near tie at the last token: the pair's pick is in the reference's top, same context
    assert canary.match_reference([5, 7, 9], [-0.1, -0.3, -0.2],
                                  [*ref[:2], {10: -0.1, 9: -0.2}]) == \
        pytest.approx([0.0, 0.0, 0.0])


def test_the_local_reference_defers_to_scoring_once_the_runs_diverge() -> None:
    ref = [{5: -0.1, 6: -2.0}, {7: -0.3}, {9: -0.2}]
    # the pair took 6 at step 0: its logprob is comparable there, later ones are not
    assert canary.match_reference([6, 7, 9], [-2.0, -0.3, -0.2], ref) is None
    # the pair's token is not in the reference's top: nothing to compare
    assert canary.match_reference([4, 7, 9], [-9.0, -0.3, -0.2], ref) is None
    assert canary.match_reference([5, 7, 9], [-0.1, -0.3, -0.2], ref[:2]) is None
    # a NaN through the pair is still a NaN: the verdict sees it
    assert canary.match_reference([5], [float("nan")], ref[:1]) == [canary.NOT_FINITE]


# --------------------------------------------------------------------- the whitelist gate

def _result(decode: str, prefill: str, passed: bool, at: float = 100.0) -> dict[str, Any]:
    return CanaryResult(prefill_replica=prefill, decode_replica=decode, passed=passed,
                        mode=CanaryMode.OUTPUT, seed=1, prompt_tokens=700, tolerance=0.5,
                        reason="" if passed else "decoded token 0 off by 3 nats",
                        deltas=[0.0] if passed else [3.0], at=at).model_dump(mode="json")


def _report(allowed: dict[str, list[str]]) -> PDReport:
    return PDReport(verdict=PDVerdict.COMPATIBLE, allowed=allowed, message="all fit.")


def test_a_pair_joins_only_after_a_clean_canary() -> None:
    watch = CanaryWatch({"period_s": 60})
    report = _report({"d1": ["p1", "p2"]})
    assert watch.due(report.allowed, now=100.0) == [("d1", "p1"), ("d1", "p2")]
    gated = watch.gate(report)
    assert gated.allowed == {"d1": []} and "2 pair(s) wait" in gated.message
    watch.take([[_result("d1", "p1", True), _result("d1", "p2", True)]])
    assert watch.gate(report).allowed == {"d1": ["p1", "p2"]}
    assert watch.due(report.allowed, now=150.0) == []
    assert len(watch.due(report.allowed, now=161.0)) == 2  # one period later


def test_a_failing_pair_is_excluded_named_and_rejoins_after_a_clean_canary() -> None:
    watch = CanaryWatch({})
    report = _report({"d1": ["p1", "p2"], "d2": ["p1"]})
    watch.take([[_result("d1", "p1", True), _result("d1", "p2", False)],
                [_result("d2", "p1", True)]])
    gated = watch.gate(report)
    assert gated.allowed == {"d1": ["p1"], "d2": ["p1"]}
    assert gated.verdict is PDVerdict.PARTIAL and gated.blocked_prefill == ["p2"]
    assert "decode d1 <- prefill p2: decoded token 0 off by 3 nats" in gated.message
    assert [c.passed for c in gated.canaries] == [True, False, True]
    assert CanaryWatch.failed_pairs(gated) == 1
    watch.take([[_result("d1", "p2", True, at=200.0)]])
    assert watch.gate(report).allowed == {"d1": ["p1", "p2"], "d2": ["p1"]}


def test_a_decode_replica_left_without_a_good_pair_prefills_locally() -> None:
    watch = CanaryWatch({})
    watch.take([[_result("d1", "p1", False)]])
    gated = watch.gate(_report({"d1": ["p1"]}))
    assert gated.allowed == {"d1": []} and gated.verdict is PDVerdict.INCOMPATIBLE


def test_results_of_gone_replicas_are_dropped_and_a_new_pair_is_canaried() -> None:
    watch = CanaryWatch({})
    watch.take([[_result("d1", "p1", True)]])
    watch.gate(_report({"d1": ["p9"]}))  # p1 replaced by p9
    assert watch.results == {}
    assert watch.due({"d1": ["p9"]}, now=101.0) == [("d1", "p9")]


def test_canary_requests_are_addressed_per_decode_replica_with_fresh_seeds() -> None:
    watch = CanaryWatch({"max_tokens": 4})
    batch = CanaryBatch.model_validate({"requests": watch.requests(
        [("d1", "p1"), ("d1", "p2"), ("d2", "p1")])})
    seeds = [r.seed for rs in batch.requests.values() for r in rs]
    assert len(set(seeds)) == 3 and [r.prefill_replica for r in batch.requests["d1"]] == \
        ["p1", "p2"] and batch.requests["d2"][0].max_tokens == 4


def test_an_answer_that_is_an_exception_is_logged_not_taken() -> None:
    watch = CanaryWatch({})
    assert watch.take([RuntimeError("replica gone"), None]) == []


# ------------------------------------------------------------------------------ the pin

def test_a_canary_request_is_pinned_to_its_prefill_replica_and_others_are_not() -> None:
    route = pd_route.Route(pins={"dsv4-canary-abc": "p7"})
    mine = SimpleNamespace(args=[SimpleNamespace(request_id="dsv4-canary-abc")])
    user = SimpleNamespace(args=[SimpleNamespace(request_id="dsv4-canary-zzz")])
    other = SimpleNamespace(args=[SimpleNamespace(request_id="cmpl-1")])
    assert pd_route.pinned(mine, route) == "p7"
    assert pd_route.pinned(user, route) is None and pd_route.pinned(other, route) is None
    assert pd_route.pinned(SimpleNamespace(args=[]), route) is None


# ------------------------------------------------------- kv_load_failure_policy, config

def _parsed(args: dict[str, Any]) -> PDAppArgs:
    parsed = parse_app_args(args)
    assert isinstance(parsed, PDAppArgs)
    return parsed


def _pd_args(**pd: Any) -> dict[str, Any]:
    raw = yaml.safe_load((CONFIGS / "local-cpu-pd.yaml").read_text())
    args = copy.deepcopy(raw["applications"][0]["args"])
    args["pd"] |= pd
    return args


def test_the_load_failure_policy_is_written_down_and_a_users_kept() -> None:
    parsed = _parsed(_pd_args())
    for pool in ("prefill", "decode"):
        assert parsed.pd.transfer_config(pool)["kv_load_failure_policy"] == "fail"
    mine = {"kv_connector": "NixlConnector", "kv_load_failure_policy": "recompute"}
    parsed = _parsed(_pd_args(kv_transfer_config=mine))
    assert parsed.pd.transfer_config("decode")["kv_load_failure_policy"] == "recompute"


def test_an_unknown_load_failure_policy_is_refused_with_the_fix() -> None:
    bad = {"kv_connector": "NixlConnector", "kv_load_failure_policy": "ignore"}
    with pytest.raises(ConfigError, match=r"kv_load_failure_policy='ignore'.*Fix: fail"):
        parse_app_args(_pd_args(kv_transfer_config=bad))


def test_canary_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="period_s"):
        parse_app_args(_pd_args(canary={"period_s": 1}))
    assert _parsed(_pd_args(canary={"enabled": False})).pd.canary.enabled is False


# ------------------------------------------------- vllm#57661 per release: plan, doctor

REGION_DEDUP = {"0.30.0": True, "0.31.0": True, "0.32.0": True, "0.33.0": True,
                "0.34.0": False}


@pytest.mark.parametrize(("release", "dedup"), REGION_DEDUP.items())
def test_the_region_dedup_fact_per_release(release: str, dedup: bool) -> None:
    """Read in each wheel (tests/test_dsv4_patch/test_release_differential.py checks it)."""
    assert rules.release_rules(release).nixl_region_dedup_by_base is dedup
    hazard = rules.nixl_region_dedup_hazard(release)
    assert (hazard is not None) is dedup
    if hazard:
        assert "vllm#57661" in hazard and "canary" in hazard


@pytest.mark.parametrize(("release", "dedup"), REGION_DEDUP.items())
def test_plan_warns_a_v41_pd_config_per_release(tmp_path: Path, release: str,
                                                dedup: bool) -> None:
    raw = yaml.safe_load((CONFIGS / "v41-flash-b200.yaml").read_text())
    args = raw["applications"][0]["args"]
    args["pd"] = {"kv_transfer_config": {"kv_connector": "NixlConnector"}}
    args["dsv4"]["vllm_version"] = release
    if args["llm"]["engine_kwargs"].get("data_parallel_size", 1) > 1:
        args["llm"]["engine_kwargs"].update(data_parallel_size=1, tensor_parallel_size=4)
    (tmp_path / "pd.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "models").symlink_to(CONFIGS / "models")
    [plan] = preflight.plan_config(tmp_path / "pd.yaml").applications
    found = [p for p in plan.problems if p.code == "pd-nixl-region-dedup"]
    if not dedup:
        assert found == []
        return
    [problem] = found
    assert problem.severity == "warning" and "vllm#57661" in problem.message
    assert "pd.canary is on" in problem.message


def test_the_warning_says_when_nothing_guards_it() -> None:
    pd = {"pools": {"prefill": {"vllm_version": "0.32.0"},
                    "decode": {"vllm_version": "0.32.0"}}, "canary": False}
    [problem] = pd_plan.region_dedup_findings(pd)
    assert "OFF: nothing guards it" in problem.message


@pytest.mark.parametrize(("release", "dedup"), REGION_DEDUP.items())
def test_doctor_names_the_hazard_per_release(release: str, dedup: bool) -> None:
    node = NodeInfo(platform="cuda", capability=(10, 0), attention_backend=None)
    text = doctor.release_status(release, node)
    assert ("vllm#57661" in text) is dedup


def test_status_names_the_failing_pair_its_deltas_and_tokens() -> None:
    from deployments.control.report import describe_pd

    watch = CanaryWatch({})
    watch.take([[_result("d1", "p1", True), _result("d1", "p2", False)]])
    gated = watch.gate(_report({"d1": ["p1", "p2"]}))
    text = "\n".join(describe_pd(cast(Any, SimpleNamespace(pd=gated))))
    assert "canary decode d1 <- prefill p2: FAILED (pair excluded)" in text
    assert "decoded token 0 off by 3 nats; deltas [3.0], tokens []" in text
    assert "canary decode d1 <- prefill p1: passed" in text
