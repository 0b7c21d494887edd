"""P/D (1 prefill + 1 decode engine, NIXL over DRAM) vs one engine, same load, one run.

Both arms are deployed side by side in one local Ray cluster (``configs/local-cpu-pd.yaml``
at ``/pd``, ``configs/local-cpu.yaml`` with one replica at ``/one``) and get the same
``vllm bench serve`` load (``deployments.harness.load``), alternating arm by arm for ``--rounds``
rounds, so machine noise hits both. Reports TTFT, TPOT and throughput per arm and their
ratios, and the cost of the P/D check itself (``compat.judge`` over N x N replicas,
and one ``/v1/kv-spec?refresh=true`` of the live P/D app).

Run under the machine lock: ``flock /tmp/dsv4-heavy.lock .venv/bin/python -m
benchmarks.pd_vs_one``. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.results import write_result
from deployments.config import DEFAULT_CONFIG, ServeApplication, load_serve_config
from deployments.control.wire import TransferSpec
from deployments.harness import load as bench_load
from deployments.harness.standin import standin_spec
from deployments.local import client, deploy, ray_head
from deployments.pd import compat
from dsv4_patch.tiny_model import ensure_tiny_model

PD_CONFIG = DEFAULT_CONFIG.parent / "local-cpu-pd.yaml"
MODEL = "dsv4-tiny"
METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "output_throughput",
           "request_throughput")


def one_engine_args() -> dict[str, Any]:
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())["applications"][0]["args"]
    args = copy.deepcopy(raw)
    args["llm"]["deployment_config"] = {"num_replicas": 1}
    return args


def deploy_arms() -> tuple[dict[str, str], Any]:
    pd_raw = yaml.safe_load(PD_CONFIG.read_text())["applications"][0]["args"]
    config = load_serve_config(PD_CONFIG)
    apps = {"pd": pd_raw, "one": one_engine_args()}
    entries = [ServeApplication(name=n, route_prefix=f"/{n}",
                                import_path="deployments.app:build_app", args=a)
               for n, a in apps.items()]
    config = config.model_copy(update={"applications": entries})
    ray_head.start_cluster(config, num_cpus=ray_head.logical_cpus_needed(config))
    deploy.deploy(config)
    urls = {n: deploy.base_url(config, f"/{n}") for n in apps}
    for url in urls.values():
        client.wait_for_verdict(url)
    return urls, config


def judge_ms(n: int, repeats: int = 3) -> float:
    """Milliseconds of one P/D judgement over n prefill x n decode replicas (pure)."""
    def spec(rid: str, pool: str) -> Any:
        t = TransferSpec(pool=pool, model_hash="sha256:x", connector="NixlConnector",
                         connector_version=14, transfer_mode="pull",
                         kv_role="kv_producer" if pool == "prefill" else "kv_consumer",
                         region_block_lens=[37440] * 43)
        return standin_spec(rid, 0).model_copy(update={"transfer": t})
    prefill = [spec(f"p{i}", "prefill") for i in range(n)]
    decode = [spec(f"d{i}", "decode") for i in range(n)]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        compat.judge(prefill, decode, {})
        times.append((time.perf_counter() - started) * 1000)
    return round(min(times), 2)


def refresh_s(url: str) -> float:
    started = time.monotonic()
    client.http_json(f"{url}/kv-spec?refresh=true", timeout=120)
    return round(time.monotonic() - started, 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=1536)
    parser.add_argument("--output-len", type=int, default=32)
    opts = parser.parse_args()
    load = bench_load.Load(num_prompts=opts.num_prompts, concurrency=opts.concurrency,
                           input_len=opts.input_len, output_len=opts.output_len)
    tokenizer = str(ensure_tiny_model())
    started = time.monotonic()
    urls, _ = deploy_arms()
    boot_s = round(time.monotonic() - started, 1)
    runs: dict[str, list[dict[str, Any]]] = {"pd": [], "one": []}
    try:
        for _ in range(opts.rounds):
            for arm, url in urls.items():
                base = url.removesuffix("/v1")
                runs[arm].append(bench_load.summary(bench_load.run(load, base, MODEL,
                                                                   tokenizer)))
        check = {"refresh_s": refresh_s(urls["pd"]),
                 "judge_ms": {n: judge_ms(n) for n in (1, 8, 32)}}
    finally:
        ray_head.shutdown()
    agg = {arm: {m: statistics.median(r[m] for r in rs if r.get(m) is not None)
                 for m in METRICS} for arm, rs in runs.items()}
    print(json.dumps({"load": load.__dict__, "boot_s": boot_s, "runs": runs, "median": agg,
                      "check": check}, indent=2, default=str))
    print(f"\n{'metric':22} {'P/D':>10} {'one engine':>12} {'P/D / one':>10}")
    for m in METRICS:
        a, b = agg["pd"][m], agg["one"][m]
        print(f"{m:22} {a:10.2f} {b:12.2f} {a / b if b else float('nan'):10.2f}")
    print(f"wrote {write_table(opts, load, agg)}")
    return 0


def write_table(opts: argparse.Namespace, load: bench_load.Load,
                agg: dict[str, dict[str, float]]) -> Path:
    """``benchmarks/results/pd_vs_one_s8.json``: the table docs/benchmarks.md shows."""
    rows = [[m, f"{agg['pd'][m]:.2f}", f"{agg['one'][m]:.2f}",
             f"{agg['pd'][m] / agg['one'][m]:.2f}" if agg["one"][m] else "n/a"]
            for m in METRICS]
    return write_result(
        "pd_vs_one_s8", title="8. Prefill/decode (NIXL over DRAM) vs one engine",
        what=("One local Ray cluster, both arms side by side: `configs/local-cpu-pd.yaml` "
              "(1 prefill + 1 decode engine of the tiny DeepSeek-V4, NixlConnector over DRAM) "
              "at `/pd` and one engine of `configs/local-cpu.yaml` at `/one`; the same "
              f"`vllm bench serve` load on each, medians of {opts.rounds} round(s)."),
        command=("flock /tmp/dsv4-heavy.lock timeout 720 python -m benchmarks.pd_vs_one "
                 f"--rounds {opts.rounds} --num-prompts {opts.num_prompts}"),
        inputs=dict(load.__dict__, rounds=opts.rounds),
        columns=["metric", "P/D", "one engine", "P/D / one"], rows=rows)


if __name__ == "__main__":
    raise SystemExit(main())
