"""What an operator sees, without a cluster: the dashboard's queries, the series, the timing.

The dashboard (``k8s/monitoring/dsv4-serve.dashboard.json``) may only name series that
code defines: ours from ``deployments.observe.series`` (what the controller and the
timing middleware create their metrics from), vLLM's from the installed vLLM's own
``loggers.py``. The live counterpart (every query returns data) is
``test_serve_metrics.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any, cast

import pytest

from deployments.control.metrics import page_bytes, replica_values
from deployments.control.wire import (
    KVCapacityPlan,
    LayerEntry,
    NodeKVCapacity,
    Prediction,
    ReplicaSpec,
)
from deployments.http import timing
from deployments.k8s.monitoring import monitors_dir, render_monitors
from deployments.observe import series
from deployments.resources import k8s_dir
from tests.support import promql, vllm_series

DASHBOARD = k8s_dir() / "monitoring" / "dsv4-serve.dashboard.json"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


def known_names() -> set[str]:
    return series.exported_names() | vllm_series.exported_names()


def test_every_dashboard_query_parses_and_names_only_defined_series() -> None:
    queries = dashboard_queries()
    assert len(queries) >= 20
    known = known_names()
    for title, expr in queries:
        names = promql.metric_names(expr)
        assert names, (title, expr)
        unknown = [n for n in names if n not in known]
        assert not unknown, f"panel {title!r} names {unknown}: no code defines them"


def test_the_template_variable_reads_a_defined_series() -> None:
    board = json.loads(DASHBOARD.read_text())
    [var] = [v for v in board["templating"]["list"] if v["name"] == "deployment"]
    metric = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["definition"])
    assert metric is not None and metric.group(1) in series.exported_names()
    assert metric.group(2) in series.AGREE.tags


def test_the_dashboard_answers_the_operator_questions() -> None:
    """Verdict, odd/drained, throughput, TTFT and TPOT split, KV vs capacity, refusals."""
    text = " ".join(expr for _, expr in dashboard_queries())
    for name in ("ray_dsv4_kv_spec_agree", "ray_dsv4_kv_spec_odd_replicas",
                 "ray_dsv4_kv_spec_drained_replicas", "ray_vllm_generation_tokens_total",
                 'stage=~"edge|engine_first_token"', 'stage="edge_stream"',
                 "ray_vllm_inter_token_latency_seconds_sum", "ray_vllm_kv_cache_usage_perc",
                 "ray_dsv4_kv_capacity_tokens", "ray_dsv4_serve_requests_refused_total"):
        assert name in text, name


@pytest.mark.parametrize("bad", [
    "sum(rate(ray_dsv4_kv_spec_agree[1m])",  # unclosed
    "sum by (le (rate(x[1m]))",
    "x{a=1}",  # a label value must be a string
    "rat(x[1m])",  # no such function
    "x[1m",
])
def test_the_promql_check_rejects_a_broken_query(bad: str) -> None:
    with pytest.raises(promql.PromQLError):
        promql.metric_names(bad)


def test_series_follow_prometheus_naming() -> None:
    names = [s.name for s in series.ALL]
    assert len(names) == len(set(names))
    for s in series.ALL:
        assert re.fullmatch(r"dsv4_[a-z0-9_]+", s.name), s.name
        assert (s.kind is series.Kind.COUNTER) == s.name.endswith("_total"), s.name
        if s.kind is series.Kind.HISTOGRAM:
            assert s.name.endswith("_seconds") and list(s.buckets) == sorted(s.buckets)
        if s.where == "controller" and s not in (series.CHECKS, series.REPLACEMENTS) \
                and s.tags != series.FLEET_TAGS:
            assert set(series.KV_TAGS) <= set(s.tags), s.name  # replica and node type


# ------------------------------------------------------------------ per-replica values


def _layer(i: int, role: str, ratio: int, page: int) -> LayerEntry:
    return LayerEntry(layer=f"model.layers.{i}.{role}", index=i, role=role,
                      spec_type="MLAAttentionSpec", cache_dtype_str="fp8_ds_mla",
                      page_size_bytes=page, block_size=256, head_size=None,
                      compress_ratio=ratio)


def spec(pages: tuple[int, int], predicted: tuple[int, int]) -> ReplicaSpec:
    """A replica whose main/indexer pages are ``pages``; the byte model said ``predicted``."""
    from deployments.control.summary import fingerprint

    layers = [_layer(0, "main", 4, pages[0]), _layer(0, "indexer", 4, pages[1])]
    want = [_layer(0, "main", 4, predicted[0]), _layer(0, "indexer", 4, predicted[1])]
    return ReplicaSpec(replica_id="r1", rank=0, node_id="n", policy="warn",
                       expected_layout="fp8_ds_mla", node={"platform": "cpu"}, layers=layers,
                       fingerprint=fingerprint(layers), cache_dtypes=["fp8_ds_mla"],
                       page_sizes=sorted(set(pages)), block_sizes=[256], workers=[],
                       prediction=Prediction(source="test", layers=want,
                                             fingerprint="sha256:" + "0" * 64))


def values(s: ReplicaSpec, plan: KVCapacityPlan) -> dict[tuple[str, tuple[tuple[str, str], ...]],
                                                         float]:
    return {(se.name, tuple(sorted(tags.items()))): v
            for se, tags, v in replica_values(s, "ok", "serve", plan)}


def test_replica_series_carry_pages_layout_and_plans_capacity() -> None:
    row = NodeKVCapacity(node_type="cpu", storage="fp8_ds_mla", block_size=256,
                         kv_bytes_per_token=366.75, kv_budget_bytes=2.0**30,
                         kv_tokens_per_engine=2927721, kv_tokens_per_replica=2927721)
    got = values(spec((1000, 200), (1000, 200)), KVCapacityPlan(nodes=[row]))
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    for (name, tags), v in got.items():
        by_name.setdefault(name, []).append((dict(tags), v))
    assert {t["node_type"] for rows in by_name.values() for t, _ in rows} == {"cpu"}
    assert by_name["dsv4_kv_layout_as_predicted"] == [
        ({"application": "", "llm_deployment": "", "replica": "r1", "node_type": "cpu"}, 1.0)]
    assert by_name["dsv4_kv_capacity_tokens"][0][1] == 2927721
    assert by_name["dsv4_kv_bytes_per_token"][0][1] == 366.75
    pages = {(t["cache_group"], t["source"]): v for t, v in by_name["dsv4_kv_page_bytes"]}
    assert pages == {("main/c4", "reported"): 1000, ("indexer/c4", "reported"): 200,
                     ("main/c4", "predicted"): 1000, ("indexer/c4", "predicted"): 200}
    odd = values(spec((1000, 264), (1000, 200)), KVCapacityPlan())
    assert odd[("dsv4_kv_layout_as_predicted", (("application", ""), ("llm_deployment", ""),
                                                ("node_type", "cpu"), ("replica", "r1")))] == 0.0
    assert not any(n == "dsv4_kv_capacity_tokens" for n, _ in odd)  # no figures: no series


def test_page_bytes_group_by_role_and_ratio() -> None:
    assert page_bytes([_layer(0, "main", 4, 10), _layer(1, "main", 4, 12),
                       _layer(2, "main", 128, 7), _layer(3, "swa", 0, 5)]) == {
        "main/c4": 12, "main/c128": 7, "swa/c1": 5}


def test_serve_series_the_dashboard_reads_are_created_by_ray() -> None:
    """Serve's series in the catalogue, as the installed Ray creates them (name, kind)."""
    import ray

    root = Path(ray.__file__).parent
    for s in series.SERVE_SERIES:
        found = [p for p in (root / "serve" / "_private").rglob("*.py")
                 if re.search(rf'metrics\.{s.kind.value.capitalize()}\(\s*"{s.name}"',
                              p.read_text())]
        assert found, f"{s.name}: no metrics.{s.kind.value.capitalize()} in Ray {ray.__version__}"


def test_capacity_figures_are_plans_for_the_same_config() -> None:
    from deployments.config import DEFAULT_CONFIG, load_serve_config
    from deployments.plan.kv_figures import plan_capacity
    from deployments.plan.preflight import plan_config

    [(app, args)] = load_serve_config(DEFAULT_CONFIG).ours()
    ours = plan_capacity(app.name, args, DEFAULT_CONFIG)
    [plan] = plan_config(DEFAULT_CONFIG).applications
    [node] = ours.nodes
    assert node.kv_tokens_per_replica == plan.capacity.kv_tokens_per_replica
    assert node.kv_bytes_per_token == plan.capacity.kv_bytes_per_token_per_gpu


def test_each_pd_pool_gets_plans_capacity_for_its_own_engine() -> None:
    from deployments.config import load_serve_config
    from deployments.config.pd import PDAppArgs
    from deployments.plan.kv_figures import plan_pool_capacities
    from deployments.plan.preflight import plan_config
    from deployments.resources import configs_dir

    path = configs_dir() / "flash-h200-pd.yaml"
    [(app, args)] = load_serve_config(path).ours()
    assert isinstance(args, PDAppArgs)
    [plan] = plan_config(path).applications
    pools = plan_pool_capacities(app.name, args, path)
    assert set(pools) == {"prefill", "decode"}
    for pool in pools.values():
        [node] = pool.nodes
        assert node.kv_tokens_per_replica == plan.capacity.kv_tokens_per_replica
        assert node.kv_bytes_per_token == plan.capacity.kv_bytes_per_token_per_gpu
    # A pool with its own tensor parallelism is sized as its own engine, not as llm's.
    args.pd.pool("prefill").engine_kwargs["tensor_parallel_size"] = 8
    wider = plan_pool_capacities(app.name, args, path)
    assert (wider["prefill"].nodes[0].kv_tokens_per_replica or 0) > (
        pools["prefill"].nodes[0].kv_tokens_per_replica or 0)
    assert wider["decode"] == pools["decode"]


# ------------------------------------------------------------------ the timing layers


class Recorded(timing.StageSeries):
    """The real series, plus the finished clocks kept for the test to read."""

    def __init__(self) -> None:
        super().__init__()
        self.clocks: list[tuple[timing.RequestClock, str]] = []

    def finished(self, clock: timing.RequestClock, method: str) -> None:
        super().finished(clock, method)
        self.clocks.append((clock, method))


def stack(app: Any, edge: Any, recorded: Recorded) -> Any:
    """timing.around([edge]) composed the way Starlette composes user middleware."""
    inner = timing.PassedEdge(app)
    return timing.TimingMiddleware(edge(inner), recorded)


async def streaming_app(scope: Any, receive: Any, send: Any) -> None:
    await asyncio.sleep(0.05)  # the engine's first token
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for chunk in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await asyncio.sleep(0.01)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def slow_edge(app: Any) -> Any:
    """An edge that takes 20 ms before the app and 5 ms on every chunk."""
    async def edge(scope: Any, receive: Any, send: Any) -> None:
        async def out(message: Any) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                time.sleep(0.005)
            await send(message)
        await asyncio.sleep(0.02)
        await app(scope, receive, out)
    return edge


def refusing_edge(reason: str | None, status: int) -> Any:
    def wrap(app: Any) -> Any:
        async def edge(scope: Any, receive: Any, send: Any) -> None:
            if reason:
                timing.note_refusal(scope, reason)
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b"{}", "more_body": False})
        return edge
    return wrap


async def call(app: Any, method: str = "POST") -> list[Any]:
    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    await app({"type": "http", "method": method, "path": "/v1/completions",
               "headers": []}, receive, send)
    return sent


def test_stages_split_the_delivered_ttft_exactly() -> None:
    recorded = Recorded()
    sent = asyncio.run(call(stack(streaming_app, slow_edge, recorded)))
    assert sent[0]["status"] == 200
    [(clock, _)] = recorded.clocks
    stages = timing.stages(clock, "POST")
    ttft = cast(float, clock.first_out) - clock.arrived  # set: the stream answered
    assert stages["edge"] + stages["engine_first_token"] == pytest.approx(ttft, abs=1e-9)
    assert stages["edge"] >= 0.02 + 0.005 * 0.9  # before the app, and the first chunk
    assert stages["engine_first_token"] >= 0.05
    assert 0.01 <= stages["edge_stream"] < 0.05  # two more chunks, 5 ms each
    assert timing.refusal_reason(clock) is None


def test_refusals_are_counted_by_the_edges_reason() -> None:
    recorded = Recorded()
    asyncio.run(call(stack(streaming_app, refusing_edge("keys", 401), recorded)))
    asyncio.run(call(stack(streaming_app, refusing_edge(None, 403), recorded)))
    reasons = [timing.refusal_reason(c) for c, _ in recorded.clocks]
    assert reasons == ["keys", "status_403"]
    assert all(timing.stages(c, m) == {} for c, m in recorded.clocks)  # never reached vLLM


def test_the_edges_refusal_is_counted_with_its_own_reason() -> None:
    """The real route gate refuses vLLM's developer route; its reason reaches the clock."""
    from deployments.http.route_gate import RouteMiddleware

    recorded = Recorded()
    app = timing.TimingMiddleware(RouteMiddleware(timing.PassedEdge(streaming_app)), recorded)
    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    asyncio.run(app({"type": "http", "method": "POST", "path": "/collective_rpc",
                     "headers": []}, receive, send))
    assert sent[0]["status"] == 404
    [(clock, _)] = recorded.clocks
    assert timing.refusal_reason(clock) == "routes" and clock.passed_edge is None


def test_gets_are_not_timed_by_stage() -> None:
    recorded = Recorded()
    asyncio.run(call(stack(streaming_app, slow_edge, recorded), method="GET"))
    [(clock, method)] = recorded.clocks
    assert clock.first_out is not None and timing.stages(clock, method) == {}


def test_around_puts_timing_outside_and_inside_the_edge() -> None:
    layers = timing.around([(slow_edge, {})])
    assert [cls for cls, _ in layers] == [timing.TimingMiddleware, slow_edge, timing.PassedEdge]


# ------------------------------------------------------------------ Kubernetes monitors


def test_pod_monitors_are_current_and_select_each_presets_pods() -> None:
    import yaml

    rendered = render_monitors()
    directory = monitors_dir()
    assert {p.name for p in directory.glob("*.podmonitor.yaml")} == set(rendered)
    for name, text in rendered.items():
        assert (directory / name).read_text() == text, \
            f"{name} is stale. Fix: python -m deployments.k8s.monitoring"
        monitor = yaml.safe_load(text)
        preset = name.removesuffix(".podmonitor.yaml")
        text_ = (k8s_dir() / f"{preset}.rayservice.yaml").read_text()
        manifest = next(iter(yaml.safe_load_all(text_)))
        spec_ = manifest["spec"]["rayClusterConfig"]
        pods = [spec_["headGroupSpec"], *spec_.get("workerGroupSpecs", [])]
        for group in pods:
            labels = group["template"]["metadata"]["labels"]
            assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
            ports = [p["name"] for c in group["template"]["spec"]["containers"]
                     for p in c.get("ports", [])]
            assert monitor["spec"]["podMetricsEndpoints"][0]["port"] in ports, (preset, ports)


class Gauges:
    """Stands in for Ray's gauges, which a process outside a cluster cannot read back."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def gauge(self, name: str) -> Any:
        values = self.values

        class One:
            def set(self, value: float, tags: dict[str, str]) -> None:
                values[(name, tuple(sorted(tags.items())))] = value
        return One()


def test_gone_replicas_series_go_to_zero_and_silent_ones_keep_theirs() -> None:
    from deployments.control.metrics import ReplicaMetrics
    from deployments.control.wire import Expected, FleetReport, State

    gauges = Gauges()
    metrics = ReplicaMetrics("dep", KVCapacityPlan())
    metrics._metrics = {name: gauges.gauge(name) for name in metrics._metrics}
    report = FleetReport(state=State.AGREE, agree=True, policy="warn",
                         expected=Expected(layout="fp8_ds_mla", reference="prediction"))
    one = spec((1000, 200), (1000, 200))
    two = one.model_copy(update={"replica_id": "r2"})

    def live(replica: str) -> dict[str, float]:
        return {k[0]: v for k, v in gauges.values.items() if dict(k[1])["replica"] == replica}

    metrics.record(report, [one, two])
    assert live("r2")["dsv4_kv_replica_info"] == 1.0
    metrics.record(report, [one], silent={"r2"})  # r2 missed a deadline: keeps its word
    assert live("r2")["dsv4_kv_replica_info"] == 1.0
    metrics.record(report, [one])  # r2 is gone
    assert set(live("r2").values()) == {0.0} and live("r1")["dsv4_kv_replica_info"] == 1.0


def test_replica_series_name_their_application() -> None:
    """Two apps built from one config share the deployment name; ``application`` (Serve's
    tag name) tells their replicas apart on the dashboard and in ``status --metrics``."""
    from deployments.control.metrics import ReplicaMetrics
    from deployments.control.wire import Expected, FleetReport, State

    gauges = Gauges()
    metrics = ReplicaMetrics("dep", KVCapacityPlan(), "app-a")
    metrics._metrics = {name: gauges.gauge(name) for name in metrics._metrics}
    report = FleetReport(state=State.AGREE, agree=True, policy="warn",
                         expected=Expected(layout="fp8_ds_mla", reference="prediction"))
    metrics.record(report, [spec((1000, 200), (1000, 200))])
    assert gauges.values and {dict(k[1])["application"] for k in gauges.values} == {"app-a"}
    assert {dict(k[1])["llm_deployment"] for k in gauges.values} == {"dep"}


def test_every_round_re_reports_unchanged_series() -> None:
    """Ray's metrics agent evicts a gauge not re-reported within two export intervals:
    an unchanged replica's series are set again on every round."""
    from deployments.control.metrics import ReplicaMetrics
    from deployments.control.wire import Expected, FleetReport, State

    gauges = Gauges()
    metrics = ReplicaMetrics("dep", KVCapacityPlan())
    metrics._metrics = {name: gauges.gauge(name) for name in metrics._metrics}
    report = FleetReport(state=State.AGREE, agree=True, policy="warn",
                         expected=Expected(layout="fp8_ds_mla", reference="prediction"))
    one = spec((1000, 200), (1000, 200))
    metrics.record(report, [one])
    first = dict(gauges.values)
    gauges.values.clear()
    metrics.record(report, [one])
    assert gauges.values == first
