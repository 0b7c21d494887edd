"""``dsv4-serve status``: plan's KV capacity per node type, and a metrics scrape per replica."""

from __future__ import annotations

from deployments.cli.status import describe_metrics
from deployments.control.report import describe
from deployments.control.wire import (
    Expected,
    FleetReport,
    KVCapacityPlan,
    NodeKVCapacity,
    ReplicaRow,
    ReplicaStatus,
    State,
)
from deployments.observe import scrape, series

DEPLOYMENT = "DSv4Server:dsv4-tiny"
APP = "dsv4"


def fleet(capacity: KVCapacityPlan | None) -> FleetReport:
    rows = [ReplicaRow(id=rid, rank=i, node_id="n1", fingerprint="sha256:" + "a" * 64,
                       status=ReplicaStatus.OK, node_type=node, block_sizes=[4, 256],
                       page_sizes=[1000], cache_dtype="fp8_ds_mla")
            for i, (rid, node) in enumerate((("r1", "sm90"), ("r2", "sm90"), ("r3", "sm100")))]
    return FleetReport(state=State.AGREE, agree=True, policy="warn", deployment=DEPLOYMENT,
                       expected=Expected(layout="fp8_ds_mla", reference="prediction"),
                       running_replicas=3, answered=3, replicas=rows, kv_capacity=capacity)


def test_status_prints_plans_capacity_per_node_type_and_each_replicas_type() -> None:
    plan = KVCapacityPlan(nodes=[
        NodeKVCapacity(node_type="sm90", storage="fp8_ds_mla", block_size=256,
                       kv_bytes_per_token=1827.0, kv_tokens_per_engine=1_000_000,
                       kv_tokens_per_replica=2_000_000),
        NodeKVCapacity(node_type="sm100", storage="nvfp4_ds_mla", block_size=256,
                       kv_bytes_per_token=1056.0)])
    text = describe(fleet(plan))
    assert "r1 rank 0 on node n1 (sm90)" in text and "(sm100)" in text
    assert "sm90: fp8_ds_mla, block 256, 1,827.00 B/token per GPU, 1,000,000 tokens per " \
           "engine, 2,000,000 per replica; 2 replica(s)" in text
    assert "sm100: nvfp4_ds_mla" in text and "tokens unknown" in text
    assert "vllm#51163" in text


def test_status_says_why_capacity_is_unknown() -> None:
    text = describe(fleet(KVCapacityPlan(reason="no config.json for x")))
    assert "KV capacity: unknown (no config.json for x)" in text
    assert "KV capacity" not in describe(fleet(None))


def exposition() -> str:
    """A scrape as Ray's agent writes it, with the names the series catalogue exports."""
    info, = series.REPLICA_INFO.exported()
    cap, = series.CAPACITY_TOKENS.exported()
    bpt, = series.BYTES_PER_TOKEN.exported()
    _, _, count = series.STAGE.exported()
    _, _, ttft_count = series.TTFT.exported()
    total, = series.STAGE_TOTAL.exported()
    ttft_sum, = series.TTFT_TOTAL.exported()
    refused, = series.REFUSED.exported()
    lines = []
    # r3: a second app built from the same config (same deployment name, another app).
    for rid, node, used, app in (("r1", "sm90", 0.5, APP), ("r2", "sm100", 0.25, APP),
                                 ("r3", "sm90", 0.75, "other-app")):
        kv = f'application="{app}",llm_deployment="{DEPLOYMENT}",replica="{rid}",' \
             f'node_type="{node}"'
        serve = f'application="{app}",deployment="{DEPLOYMENT}",replica="{rid}"'
        lines += [
            f'{info}{{{kv},status="ok",action="serve"}} 1.0',
            f'{cap}{{{kv}}} 1000.0', f'{bpt}{{{kv}}} 366.75',
            f'ray_vllm_kv_cache_usage_perc{{ReplicaId="{rid}"}} {used}',
            f'ray_vllm_generation_tokens_total{{ReplicaId="{rid}"}} 40.0',
            f'{total}{{{serve},stage="edge"}} 0.02', f'{count}{{{serve},stage="edge"}} 4.0',
            f'{total}{{{serve},stage="engine_first_token"}} 0.38',
            f'{count}{{{serve},stage="engine_first_token"}} 4.0',
            f'{ttft_sum}{{{serve}}} 0.4', f'{ttft_count}{{{serve}}} 4.0',
            f'{refused}{{{serve},reason="keys"}} 2.0']
    lines.append(f'{info}{{llm_deployment="other",replica="x",node_type="cpu",status="ok",'
                 'action="serve"} 1.0')
    lines.append(f'{info}{{llm_deployment="{DEPLOYMENT}",replica="gone",node_type="cpu",'
                 'status="ok",action="serve"} 0.0')
    return "\n".join(lines) + "\n"


def test_scrape_gives_each_replicas_figures_and_the_ttft_split() -> None:
    figures = scrape.per_replica(scrape.samples(exposition()), DEPLOYMENT, APP)
    assert set(figures) == {"r1", "r2"}  # not another app's, not a gone replica
    assert set(scrape.per_replica(scrape.samples(exposition()), DEPLOYMENT)) == \
        {"r1", "r2", "r3"}  # no application named: every app of that deployment
    r1 = figures["r1"]
    assert (r1.node_type, r1.kv_capacity_tokens, r1.kv_usage) == ("sm90", 1000.0, 0.5)
    assert r1.ttft_mean == 0.1 and r1.mean("edge") == 0.005
    assert r1.refused == {"keys": 2.0}
    text = "\n".join(scrape.describe(figures))
    assert "r1 [sm90]: KV 50.0% of 1,000 tokens (367 B/token)" in text
    assert "TTFT 100.0 ms = edge 5.0 ms + engine 95.0 ms; refused keys 2" in text
    assert "sm90: 1 replica(s), KV 500 of 1,000 tokens in use" in text
    assert "sm100: 1 replica(s), KV 250 of 1,000 tokens in use" in text


def test_a_replica_that_does_not_serve_as_usual_says_so() -> None:
    info = {"node_type": "sm90", "status": "odd", "action": "drain"}
    [_, line, *_] = scrape.describe({"r": scrape.ReplicaFigures("r", info=info)})
    assert line.startswith("    r [sm90, odd: drain]: KV ?"), line
    [_, line, *_] = scrape.describe({"r": scrape.ReplicaFigures("r", info={"status": "ok"})})
    assert line.startswith("    r [?]: KV ?"), line


def test_an_unreachable_metrics_endpoint_is_named_with_the_fix() -> None:
    [line] = describe_metrics("http://127.0.0.1:9/metrics", fleet(None))
    assert "cannot read http://127.0.0.1:9/metrics" in line and "Fix:" in line
    assert describe_metrics(None, fleet(None)) == []
