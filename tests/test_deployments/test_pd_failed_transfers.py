"""A failed KV receive takes its decode replica's pairs out of routing, without engines.

The counter: ``deployments.pd.failed_transfers.TalliedCounter`` fed by the installed
vLLM's own ``NixlPromMetrics`` and ``NixlKVConnectorStats`` (what the decode replica's
stat logger runs), compared with vLLM's ``RayCounterWrapper`` on the same stats. The
rule: ``CanaryWatch.take_counts``. On real engines with a failing receive:
tests/test_deployments/test_pd_canary.py (``make test-pd``).
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import yaml

from deployments.config import checks, parse_app_args
from deployments.control.canary_wire import CanaryMode, CanaryResult
from deployments.control.wire import PDReport, PDRouteAck, PDVerdict
from deployments.pd import failed_transfers
from deployments.pd.canary_watch import CanaryWatch, rise

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


# ----------------------------------------------------------------------- the counter

def _nixl_metrics(counter_cls: type) -> Any:
    """vLLM's NIXL Prometheus metrics for one engine, counters built by ``counter_cls``."""
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlPromMetrics
    from vllm.v1.metrics.ray_wrappers import RayGaugeWrapper, RayHistogramWrapper

    types = {Gauge: RayGaugeWrapper, Counter: counter_cls, Histogram: RayHistogramWrapper}
    return NixlPromMetrics(cast(Any, SimpleNamespace(kv_transfer_config=None)), types,
                           ["model_name", "engine"], {0: ["dsv4-tiny", "0"]})


def _failures() -> dict[str, Any]:
    """One step's stats: 2 failed READs, 1 handshake, 1 notification, 1 expired request."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    stats = NixlKVConnectorStats()
    stats.record_failed_transfer()
    stats.record_failed_transfer()
    stats.record_failed_handshake()
    stats.record_failed_notification()
    stats.record_kv_expired_req()
    return stats.data


def _ray_incs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float, dict[str, str]]]:
    from ray.util import metrics as ray_metrics

    calls: list[tuple[str, float, dict[str, str]]] = []

    def inc(self: Any, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        calls.append((self._name, value, dict(tags or {})))

    monkeypatch.setattr(ray_metrics.Counter, "inc", inc)
    return calls


def test_the_counter_tallies_vllms_failed_transfers_and_still_feeds_rays_counter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM adds failed READs, handshakes and notifications into one counter: the tally
    is that counter's total, and Ray gets exactly what vLLM's own wrapper sends it."""
    from vllm.v1.metrics.ray_wrappers import RayCounterWrapper

    tally = failed_transfers.Tally()
    monkeypatch.setattr(failed_transfers, "TALLY", tally)
    calls = _ray_incs(monkeypatch)
    _nixl_metrics(RayCounterWrapper).observe(_failures(), 0)
    theirs = list(calls)
    calls.clear()
    ours = _nixl_metrics(failed_transfers.counter_class())
    assert tally.built and tally.total == 0
    ours.observe(_failures(), 0)
    assert calls == theirs
    assert sum(v for name, v, _ in theirs if name == "vllm_nixl_num_failed_transfers") == 4
    assert tally.total == 4  # the expired request and the second notification count apart
    ours.observe(_failures(), 0)
    assert tally.total == 8


def test_the_counter_keeps_the_vllm_wrappers_api() -> None:
    from vllm.v1.metrics.ray_wrappers import RayCounterWrapper

    ours = failed_transfers.counter_class()
    for method in ("__init__", "inc"):
        assert inspect.signature(getattr(ours, method)).parameters.keys() == \
            inspect.signature(getattr(RayCounterWrapper, method)).parameters.keys(), method
    assert issubclass(ours, RayCounterWrapper)


def test_install_swaps_the_connector_counters_once_and_reading_says_why_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.metrics import ray_wrappers

    tally = failed_transfers.Tally()
    monkeypatch.setattr(failed_transfers, "TALLY", tally)
    monkeypatch.setattr(failed_transfers, "_state", dict(failed_transfers._state))
    before = ray_wrappers.RayKVConnectorProm._counter_cls
    assert failed_transfers.reading(True)[0] is None  # not installed yet
    try:
        assert failed_transfers.install()
        installed = ray_wrappers.RayKVConnectorProm._counter_cls
        assert getattr(installed, "dsv4_tallied", False)
        assert failed_transfers.install() and \
            ray_wrappers.RayKVConnectorProm._counter_cls is installed
        assert ray_wrappers.RayPrometheusStatLogger._counter_cls is \
            ray_wrappers.RayCounterWrapper  # the engine's own counters are untouched
        count, why = failed_transfers.reading(True)
        assert count is None and "no vllm:nixl_num_failed_transfers counter" in str(why)
        count, why = failed_transfers.reading(False)
        assert count is None and "llm.log_engine_metrics is false" in str(why) \
            and "Fix:" in str(why)
        _nixl_metrics(installed).observe(_failures(), 0)
        assert failed_transfers.reading(None) == (4, None)
    finally:
        ray_wrappers.RayKVConnectorProm._counter_cls = before


# -------------------------------------------------------------------------- the rule

def _ack(decode: str, count: int | None, why: str | None = None) -> PDRouteAck:
    return PDRouteAck(replica_id=decode, allowed=[], failed_kv_transfers=count,
                      failed_kv_transfers_unread=why)


def _passed(decode: str, prefill: str, at: float = 100.0) -> dict[str, Any]:
    return CanaryResult(prefill_replica=prefill, decode_replica=decode, passed=True,
                        mode=CanaryMode.OUTPUT, seed=1, prompt_tokens=700, tolerance=1.0,
                        deltas=[0.01], max_delta=0.01, at=at).model_dump(mode="json")


PAIRS = {"d1": ["p1", "p2"], "d2": ["p1"]}


def _clean_watch(**settings: Any) -> CanaryWatch:
    watch = CanaryWatch({"period_s": 60} | settings)
    watch.take([[_passed("d1", "p1"), _passed("d1", "p2")], [_passed("d2", "p1")]])
    assert watch.take_counts([_ack("d1", 0), _ack("d2", 3)], PAIRS, 100.0) == {}
    return watch


def test_a_rise_fails_every_pair_of_that_decode_replica_at_once_naming_it() -> None:
    watch = _clean_watch()
    assert watch.take_counts([_ack("d1", 2), _ack("d2", 3)], PAIRS, 110.0) == {"d1": 2}
    gated = watch.gate(PDReport(verdict=PDVerdict.COMPATIBLE, allowed=PAIRS))
    assert gated.allowed == {"d1": [], "d2": ["p1"]}
    assert gated.verdict is PDVerdict.INCOMPATIBLE  # d1 is left without a pair
    bad = [c for c in gated.canaries if not c.passed]
    assert [c.pair for c in bad] == [("d1", "p1"), ("d1", "p2")]
    for c in bad:
        assert c.failed_kv_transfers == 2 and c.at == 110.0 and c.tokens == []
        assert "decode replica d1 counted 2 failed KV transfer(s)" in c.reason
        assert "2 since it started" in c.reason
    assert "decode d1 <- prefill p1: decode replica d1 counted 2" in gated.message
    # due now, not a period later; the other decode replica's pair is not
    assert watch.due(PAIRS, now=111.0) == [("d1", "p1"), ("d1", "p2")]
    assert watch.totals == {"run": 3, "failed": 0, "failed_by_counter": 2}
    # each rejoins after a clean canary (the existing rule), the count standing still
    watch.take([[_passed("d1", "p1", at=120.0)]])
    assert watch.take_counts([_ack("d1", 2), _ack("d2", 3)], PAIRS, 125.0) == {}
    assert watch.gate(PDReport(verdict=PDVerdict.COMPATIBLE, allowed=PAIRS)).allowed == \
        {"d1": ["p1"], "d2": ["p1"]}
    assert watch.due(PAIRS, now=126.0) == [("d1", "p2")]


def test_no_rise_changes_nothing() -> None:
    watch = _clean_watch()
    before = dict(watch.results)
    for now in (110.0, 120.0):
        assert watch.take_counts([_ack("d1", 0), _ack("d2", 3)], PAIRS, now) == {}
    assert watch.results == before and watch.due(PAIRS, now=121.0) == []
    assert watch.failed_transfers == {"d1": 0, "d2": 3}


def test_a_first_count_and_a_restarted_count_are_not_rises() -> None:
    """A replica's first count (or a restarted controller's first look) is where it
    starts; a count that went down is a process counting from 0 again."""
    assert rise(None, 5) == 0 and rise(5, 0) == 0 and rise(5, None) == 0
    assert rise(0, 1) == 1 and rise(3, 3) == 0
    watch = _clean_watch()  # d2 started at 3
    assert watch.take_counts([_ack("d1", 0), _ack("d2", 0)], PAIRS, 110.0) == {}
    assert all(r.passed for r in watch.results.values())
    assert watch.take_counts([_ack("d1", 0), _ack("d2", 1)], PAIRS, 120.0) == {"d2": 1}
    assert not watch.results[("d2", "p1")].passed


def test_a_replica_that_cannot_count_is_named_not_guessed() -> None:
    watch = _clean_watch()
    why = "llm.log_engine_metrics is false: ..."
    assert watch.take_counts([_ack("d1", None, why), _ack("d2", 3)], PAIRS, 110.0) == {}
    assert watch.unread == {"d1": why} and watch.failed_transfers["d1"] == 0
    old = PDRouteAck.model_validate({"replica_id": "d2", "allowed": ["p1"]})  # older replica
    watch.take_counts([old], PAIRS, 120.0)
    assert "an older dsv4-serve" in watch.unread["d2"]
    watch.take_counts([_ack("d1", 0), _ack("d2", 3)], {"d1": ["p1"]}, 130.0)
    assert watch.unread == {} and set(watch.failed_transfers) == {"d1", "d2"}
    watch.take_counts([], {"d1": ["p1"]}, 140.0)  # d2 is gone
    assert set(watch.failed_transfers) == {"d1"}


def test_with_the_canary_off_a_rise_is_counted_but_excludes_nothing() -> None:
    watch = _clean_watch(enabled=False)
    assert watch.take_counts([_ack("d1", 1), _ack("d2", 3)], PAIRS, 110.0) == {"d1": 1}
    assert all(r.passed for r in watch.results.values())
    assert watch.failed_transfers["d1"] == 1


def test_a_counter_failure_keeps_the_pairs_own_canary_reason() -> None:
    watch = _clean_watch()
    failed = CanaryResult.model_validate(_passed("d1", "p1", at=105.0)).model_copy(
        update={"passed": False, "reason": "the decode request through the pair finished "
                "with 'error'"})
    watch.take([[failed.model_dump(mode="json")]])
    watch.take_counts([_ack("d1", 1), _ack("d2", 3)], PAIRS, 110.0)
    reason = watch.results[("d1", "p1")].reason
    assert reason.startswith("decode replica d1 counted 1 failed KV transfer(s)")
    assert reason.endswith("the pair's last canary: the decode request through the pair "
                           "finished with 'error'")
    assert "last canary" not in watch.results[("d1", "p2")].reason


def test_status_names_each_decode_replicas_count_and_the_failed_pairs() -> None:
    from deployments.control.report import describe_pd

    watch = _clean_watch()
    watch.take_counts([_ack("d1", 2), _ack("d2", 3)], PAIRS, 110.0)
    gated = watch.gate(PDReport(verdict=PDVerdict.COMPATIBLE, allowed=PAIRS)).model_copy(
        update={"failed_kv_transfers": watch.failed_transfers})
    text = "\n".join(describe_pd(cast(Any, SimpleNamespace(pd=gated))))
    assert "decode d1 takes KV from prefill none (prefills locally); 2 failed KV " \
        "transfer(s) counted" in text
    assert "decode d2 takes KV from prefill ['p1']; 3 failed KV transfer(s) counted" in text
    assert "canary decode d1 <- prefill p2: FAILED (pair excluded)" in text
    assert "decode replica d1 counted 2 failed KV transfer(s)" in text


# ------------------------------------------------------------------------- the config

def _pd_args(**llm: Any) -> dict[str, Any]:
    raw = yaml.safe_load((CONFIGS / "local-cpu-pd.yaml").read_text())
    args = copy.deepcopy(raw["applications"][0]["args"])
    args["llm"] |= llm
    return args


def test_log_engine_metrics_off_in_a_pd_app_is_named_with_the_fix() -> None:
    found = checks.check(parse_app_args(_pd_args(log_engine_metrics=False)))
    [problem] = [p for p in found if p.code == "pd-failed-transfers-unread"]
    assert problem.severity == "warning"
    assert "llm.log_engine_metrics=false" in problem.message and "Fix:" in problem.message
    for args in (_pd_args(), _pd_args(log_engine_metrics=True)):
        assert not [p for p in checks.check(parse_app_args(args))
                    if p.code == "pd-failed-transfers-unread"]
    one_pool = _pd_args(log_engine_metrics=False)
    del one_pool["pd"]
    assert not [p for p in checks.check(parse_app_args(one_pool))
                if p.code == "pd-failed-transfers-unread"]


# --------------------------------------------------------------- the controller's check

class _Pool:
    """A pool controller as the P/D controller reads it: its specs, and its decode
    replicas' answers to ``apply_pd_route`` (each call takes the next count)."""

    def __init__(self, name: str, specs: list[Any], counts: list[int] | None = None):
        from deployments.control.wire import State

        self.specs, self._counts = specs, list(counts or [])
        self.pushed: list[dict[str, list[str]]] = []
        self._server = SimpleNamespace(deployment_name=name)
        self.current = lambda: SimpleNamespace(state=State.AGREE)

    async def _call_each(self, method: str, message: dict[str, Any]) -> tuple[list[Any], int,
                                                                              None]:
        assert method == "apply_pd_route"
        self.pushed.append(message["allowed"])
        count = self._counts.pop(0)
        return [_ack(s.replica_id, count).model_dump(mode="json") for s in self.specs], 0, None


def _replica(rid: str, pool: str) -> Any:
    """A replica's spec with a transfer spec both pools share (deployments.pd.compat)."""
    from deployments.control.wire import TransferSpec
    from deployments.harness.standin import standin_spec

    transfer = TransferSpec(pool=cast(Any, pool), model_hash="sha256:abc",
                            connector="NixlConnector", connector_version=14,
                            kv_role="kv_producer" if pool == "prefill" else "kv_consumer",
                            transfer_mode="pull", backend_names=["CPU_DSV4"],
                            kv_cache_layout="NHD", kernel_block_size=256,
                            region_block_lens=[37440])
    return standin_spec(rid, 0).model_copy(update={"transfer": transfer})


def test_the_check_sends_the_whitelists_again_at_once_when_a_count_rose() -> None:
    import asyncio

    from deployments.pd.controller import PDController

    decode = _Pool("Decode", [_replica("d0", "decode")], counts=[0, 0, 3, 3, 3])
    ctrl = PDController.__new__(PDController)
    ctrl._pools = cast(Any, {"prefill": _Pool("Prefill", [_replica("p0", "prefill")]),
                             "decode": decode})
    ctrl._decode, ctrl._lock = cast(Any, decode), asyncio.Lock()
    ctrl._pd = PDReport(verdict=PDVerdict.NOT_CHECKED)
    ctrl._metrics = cast(Any, SimpleNamespace(record=lambda pd: None))
    ctrl._canary = CanaryWatch({"period_s": 60})
    first = asyncio.run(ctrl.judge())
    assert first.allowed == {"d0": []} and first.failed_kv_transfers == {"d0": 0}
    ctrl._canary.take([[_passed("d0", "p0")]])
    assert asyncio.run(ctrl.judge()).allowed == {"d0": ["p0"]}
    rose = asyncio.run(ctrl.judge())  # the count went 0 -> 3: pushed again in this check
    assert decode.pushed == [{"d0": []}, {"d0": ["p0"]}, {"d0": ["p0"]}, {"d0": []}]
    assert rose.allowed == {"d0": []} and rose.failed_kv_transfers == {"d0": 3}
    [failed] = rose.canaries
    assert failed.failed_kv_transfers == 3 and "decode replica d0 counted 3" in failed.reason
    assert ctrl._canary.due(rose.allowed | {"d0": ["p0"]}, now=failed.at + 1) == [("d0", "p0")]
