"""The project's Prometheus series, scraped from Ray's metrics endpoint of the session stack.

``ray.serve.metrics`` series are exported by Ray's per-node metrics agent
(``ray_head.start_cluster`` gives it a known port; ``ray_head.metrics_url``), prefixed
``ray_``, about one report interval (~10 s) after the controller sets them. The
session stack runs 2 agreeing replicas, so the gauges must say agree=1, running=2,
answered=2, odd=0 for the ``dsv4`` application, and checks with state ``agree``
must have been counted.

After some traffic (streamed completions, a refused request), every series the
Grafana dashboard (``k8s/monitoring/``) names must have a sample for this app, the
serving path's stages must add up to the TTFT the replica delivered (the serving
part and the engine's part), and the KV capacity gauges must be ``dsv4-serve plan``'s
figures for the same config.
"""

from __future__ import annotations

import itertools
import json
import time
import urllib.request
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import promql
from tests.support.serve_client import wait_agree
from tests.support.stack import Stack

pytestmark = pytest.mark.slow

APP = "dsv4"
SCRAPE_TIMEOUT_S = 90.0
EXPECTED = {"ray_dsv4_kv_spec_agree": 1.0, "ray_dsv4_kv_spec_running_replicas": 2.0,
            "ray_dsv4_kv_spec_answered_replicas": 2.0, "ray_dsv4_kv_spec_odd_replicas": 0.0}
CHECKS = "ray_dsv4_kv_spec_checks_total"


def controller_replica_id() -> str:
    """The unique id of the running KV-spec controller replica of the app."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#KVSpecController#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(prefix)]
    assert len(names) == 1, f"expected one controller replica, found {names}"
    return names[0][len(prefix):]


def scrape(url: str, replica: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """dsv4 samples of the app's current controller replica: name -> [(labels, value)].

    A controller killed by an earlier test leaves its last series behind until Ray
    expires them; the ``replica`` label tells the current one apart.
    """
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (sample.name.startswith("ray_dsv4_kv_spec") and labels.get("application") == APP
                    and labels.get("replica", "").endswith(replica)):
                samples.setdefault(sample.name, []).append((labels, sample.value))
    return samples


def test_kv_spec_gauges_are_exported_with_the_verdict(serve_stack: Stack) -> None:
    from deployments.local import ray_head

    report = wait_agree(serve_stack.url, 2)
    url = ray_head.metrics_url()
    replica = controller_replica_id()
    started = time.monotonic()
    deadline = started + SCRAPE_TIMEOUT_S
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    while time.monotonic() < deadline:
        samples = scrape(url, replica)
        values = {name: [v for _, v in samples.get(name, [])] for name in EXPECTED}
        if all(values[name] == [want] for name, want in EXPECTED.items()) and any(
                n.startswith(CHECKS) for n in samples):
            break
        time.sleep(2)
    print(f"{url} after {time.monotonic() - started:.1f} s: "
          + "; ".join(f"{n}={[v for _, v in s]}" for n, s in sorted(samples.items())))
    if not samples:  # show what is there, e.g. if Serve's tag names change
        with urllib.request.urlopen(url, timeout=10) as resp:
            print([line for line in resp.read().decode().splitlines() if "dsv4_kv" in line])
    for name, want in EXPECTED.items():
        assert [v for _, v in samples.get(name, [])] == [want], (name, samples.get(name))
    [(labels, _)] = samples["ray_dsv4_kv_spec_agree"]
    assert labels["llm_deployment"] == report["deployment"], labels
    checks = {labels["state"]: value for name, series in samples.items()
              if name.startswith(CHECKS) and not name.endswith("_created")
              for labels, value in series}
    assert checks.get("agree", 0) >= 1, checks


def dashboard_names() -> set[str]:
    """Every metric the committed dashboard's queries name."""
    from deployments.resources import k8s_dir

    board = json.loads((k8s_dir() / "monitoring" / "dsv4-serve.dashboard.json").read_text())
    return {name for panel in board["panels"] for target in panel.get("targets", [])
            for name in promql.metric_names(target["expr"])}


def send_traffic(url: str, model: str) -> None:
    """Streamed and plain completions and chats, and one request the edge refuses."""
    with httpx.Client(timeout=120) as http:
        for i in range(4):
            body = {"model": model, "prompt": f"Observability {i}", "max_tokens": 8,
                    "temperature": 0.0, "stream": i % 2 == 0}
            resp = http.post(f"{url}/completions", json=body)
            assert resp.status_code == 200, resp.text[:300]
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8, "stream": True}
        assert http.post(f"{url}/chat/completions", json=chat).status_code == 200
        # vLLM's developer route: closed at the edge (deployments.http.routes)
        refused = http.post(f"{url.removesuffix('/v1')}/collective_rpc", json={})
        assert refused.status_code in (404, 405), refused.text[:300]


def keep_busy(url: str, model: str, times: int = 2) -> None:
    """Short completions, each on its own connection (the shared port spreads
    connections, not requests, across the replicas)."""
    for i in range(times):
        body = {"model": model, "prompt": f"busy {i}", "max_tokens": 4}
        resp = httpx.post(f"{url}/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text[:300]


def ours(name: str, labels: dict[str, str], deployment: str) -> bool:
    """A sample of this app: by the deployment and application labels the series carries
    (the dashboard's ``$deployment`` and ``$application``; the session's second app,
    ``conftest.mixed_app``, has the same deployment name)."""
    if name.startswith("ray_vllm_"):
        return True  # tagged ReplicaId only; joined to the app through dsv4_kv_replica_info
    return (deployment in (labels.get("llm_deployment"), labels.get("deployment"))
            and labels.get("application") == APP)


def missing(scraped: dict[str, list[tuple[dict[str, str], float]]], deployment: str,
            names: set[str]) -> list[str]:
    return sorted(n for n in names
                  if not any(ours(n, lb, deployment) for lb, _ in scraped.get(n, [])))


def split(f: Any) -> bool:
    """The replica's stages add up to its delivered TTFT (exact seconds, same counts)."""
    edge = f.stage_seconds.get("edge", (0.0, 0.0))
    engine = f.stage_seconds.get("engine_first_token", (0.0, 0.0))
    return edge[1] == engine[1] == f.ttft[1] and \
        abs(edge[0] + engine[0] - f.ttft[0]) <= 1e-6 * max(f.ttft[0], 1.0)


def test_every_dashboard_series_answers_after_traffic(serve_stack: Stack) -> None:
    from deployments.config import DEFAULT_CONFIG
    from deployments.local import ray_head
    from deployments.observe import scrape
    from deployments.plan.preflight import plan_config

    report = wait_agree(serve_stack.url, 2)
    deployment = report["deployment"]
    send_traffic(serve_stack.url, serve_stack.model)
    names = dashboard_names()
    url = ray_head.metrics_url()
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    scraped: dict[str, Any] = {}
    while time.monotonic() < deadline:
        # vLLM sets its gauges only while its engine steps, and Ray's agent evicts a
        # gauge not re-reported within two export intervals: scrape a replica at work.
        keep_busy(serve_stack.url, serve_stack.model)
        # ... and once through Serve's proxy (the second door), whose router wait is
        # the dashboard's queueing/routing stage.
        proxy = f"http://127.0.0.1:{serve_stack.config.http_options.port}/v1"
        keep_busy(proxy, serve_stack.model, times=1)
        scraped = scrape.samples(scrape.read(url))
        figures = scrape.per_replica(scraped, deployment, APP)
        if not missing(scraped, deployment, names) and len(figures) >= 2 and all(
                split(f) for f in figures.values() if f.ttft[1]):
            break
        time.sleep(2)
    assert not missing(scraped, deployment, names), \
        f"dashboard series without a sample for {deployment}: " \
        f"{missing(scraped, deployment, names)}"
    figures = scrape.per_replica(scraped, deployment, APP)
    print("\n".join(scrape.describe(figures)))
    assert_engine_histograms_whole(scraped)

    # The serving path's part + the engine's part = the TTFT the replica delivered.
    timed = [f for f in figures.values() if f.ttft[1]]
    assert timed, figures
    for f in timed:
        edge, engine = f.stage_seconds["edge"], f.stage_seconds["engine_first_token"]
        assert edge[1] == engine[1] == f.ttft[1], f
        assert edge[0] + engine[0] == pytest.approx(f.ttft[0], rel=1e-6, abs=1e-6), f
        assert 0 < edge[0] < f.ttft[0] and engine[0] > 0, f
    reasons = {r for f in figures.values() for r in f.refused}
    assert "routes" in reasons, reasons  # the edge's own reason (problem.refuse)

    # KV capacity: plan's figures for the same config, on every replica.
    [plan] = plan_config(DEFAULT_CONFIG).applications
    live = [f for f in figures.values() if f.node_type is not None]
    assert {f.replica for f in live} == {r["id"] for r in report["replicas"]}, figures
    for f in live:
        assert f.node_type == "cpu" and f.info["status"] == "ok", f
        assert f.kv_capacity_tokens == plan.capacity.kv_tokens_per_replica, f
        assert f.kv_bytes_per_token == pytest.approx(plan.capacity.kv_bytes_per_token_per_gpu)


def assert_engine_histograms_whole(scraped: dict[str, Any]) -> None:
    """vLLM's histograms, counted in each replica (``serving.engine_metrics``), reach
    Prometheus as whole histograms: per replica, every ``le`` bucket of each, cumulative,
    the ``+Inf`` bucket equal to ``_count``, and a sum."""
    from vllm.v1.metrics.buckets import histogram_buckets

    itl_bounds = histogram_buckets("inter_token_latency")
    name = "ray_vllm_inter_token_latency_seconds"
    counts = {lb["ReplicaId"]: v for lb, v in scraped.get(f"{name}_count", [])}
    sums = {lb["ReplicaId"]: v for lb, v in scraped.get(f"{name}_sum", [])}
    buckets: dict[str, list[tuple[float, float]]] = {}
    for lb, v in scraped.get(f"{name}_bucket", []):
        buckets.setdefault(lb["ReplicaId"], []).append((float(lb["le"]), v))
    assert counts and any(counts.values()), counts
    for replica, count in counts.items():
        ordered = sorted(buckets[replica])
        assert ordered[-1] == (float("inf"), count), (replica, ordered)
        assert all(a[1] <= b[1] for a, b in itertools.pairwise(ordered)), ordered
        assert len(ordered) == len(itl_bounds) + 1, ordered  # and +Inf
        assert (sums[replica] > 0) is (count > 0), (replica, sums)


IDLE_S = 30.0  # past two of Ray's ~10 s export intervals, when the agent drops unset gauges
IDLE_SCRAPE_EVERY_S = 2.5
HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")


def engine_gauges(text: str) -> dict[str, dict[str, float]]:
    """vLLM's gauges in a scrape (not its counters, not our histogram-total gauges):
    name -> {ReplicaId: value}, summed over the other labels."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "gauge" or not family.name.startswith("ray_vllm_") or \
                family.name.endswith(HISTOGRAM_PARTS):
            continue
        for sample in family.samples:
            per = out.setdefault(sample.name, {})
            replica = sample.labels.get("ReplicaId", "")
            per[replica] = per.get(replica, 0.0) + sample.value
    return out


def test_engine_gauges_stay_while_the_fleet_idles(serve_stack: Stack) -> None:
    """Every vLLM gauge a replica exported under load is in every scrape of an idle
    fleet, past the two export intervals after which Ray's agent drops a gauge nobody
    set (``serving.engine_metrics.KeptGauge``), and nothing is running or waiting."""
    from deployments.local import ray_head
    from deployments.observe import scrape

    report = wait_agree(serve_stack.url, 2)
    replicas = {r["id"] for r in report["replicas"]}
    for _ in range(2):  # a request per connection: the shared port spreads connections
        keep_busy(serve_stack.url, serve_stack.model, times=2)
    url = ray_head.metrics_url()
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    busy: dict[str, dict[str, float]] = {}
    while time.monotonic() < deadline:
        busy = engine_gauges(scrape.read(url))
        running = busy.get("ray_vllm_num_requests_running", {})
        if replicas <= set(running):
            break
        keep_busy(serve_stack.url, serve_stack.model, times=2)
        time.sleep(2)
    assert replicas <= set(busy.get("ray_vllm_num_requests_running", {})), busy
    wanted = {name for name, per in busy.items() if replicas <= set(per)}
    assert {"ray_vllm_kv_cache_usage_perc", "ray_vllm_num_requests_waiting"} <= wanted, wanted
    idle_from = time.monotonic()
    scrapes, last_s, absent = 0, 0.0, []
    while time.monotonic() < idle_from + IDLE_S:
        time.sleep(IDLE_SCRAPE_EVERY_S)
        idle = engine_gauges(scrape.read(url))
        scrapes, last_s = scrapes + 1, time.monotonic() - idle_from
        absent += [(scrapes, n, sorted(replicas - set(idle.get(n, {})))) for n in wanted
                   if not replicas <= set(idle.get(n, {}))]
    print(f"{scrapes} idle scrapes over {IDLE_S:g} s (last at {last_s:.1f} s), "
          f"{len(wanted)} vLLM gauges each: {sorted(wanted)}")
    # Several scrapes (a scrape takes ~0.5 s here, seconds on a busy box), the last one
    # past two of Ray's export intervals after the load, and every gauge in every one.
    assert scrapes >= 3 and last_s >= IDLE_S - IDLE_SCRAPE_EVERY_S, (scrapes, last_s)
    assert not absent, absent
    for name in ("ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting"):
        assert all(idle[name][r] == 0 for r in replicas), (name, idle[name])
