"""The tables of ``benchmarks.serving_overhead``: medians, spreads, ratios, merged rounds."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.multinode_arms import CPU_VIEWS, cpu_table
from benchmarks.overhead_arms import ARMS

METRICS = (  # (key, label, higher is better)
    ("request_throughput", "req/s", True),
    ("output_throughput", "out tok/s", True),
    ("median_ttft_ms", "TTFT p50 ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("median_tpot_ms", "TPOT p50 ms", False),
    ("p99_tpot_ms", "TPOT p99 ms", False),
)


KEYS = (*(k for k, _, _ in METRICS), "boot_s", "arm_busy_at_rest_pct")


def by_load(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The runs split per load (runs from before ``--loads`` have no label: one load)."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for arm, rs in runs.items():
        for r in rs:
            out.setdefault(r.get("load", "load"), {}).setdefault(arm, []).append(r)
    return out


def tables(runs: dict[str, list[dict[str, Any]]]) -> str:
    """One markdown table per load, and the CPU by process of the runs that recorded it."""
    return "\n\n".join(
        f"**{label}**\n\n{table(aggregate(rs))}\n\n" + "\n\n".join(
            t for key, _ in CPU_VIEWS if (t := cpu_table(rs, ARMS, key)))
        for label, rs in by_load(runs).items())


def aggregate(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per arm and metric: median, min and max over the runs; failed requests summed."""
    out: dict[str, dict[str, Any]] = {}
    for arm, rs in runs.items():
        if not rs:
            continue
        stats: dict[str, Any] = {k: {"median": statistics.median(r[k] for r in rs),
                                     "min": min(r[k] for r in rs), "max": max(r[k] for r in rs)}
                                 for k in KEYS if all(k in r for r in rs)}
        out[arm] = stats | {"failed": sum(r["failed"] for r in rs), "runs": len(rs),
                            "by_round": by_round(rs)}
    return out


def by_round(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """An arm's runs keyed "round.n" (the n-th run of that round; a JSON key): what
    pairs it with the other arms' runs of the same round (alternating order, the same
    box state)."""
    seen: dict[int, int] = {}
    out = {}
    for r in runs:
        rnd = r.get("round", 0)
        seen[rnd] = seen.get(rnd, -1) + 1
        out[f"{rnd}.{seen[rnd]}"] = r
    return out


def paired_ratio(agg: dict[str, dict[str, Any]], key: str, other: str,
                 arm: str = "ours") -> float | None:
    """The median over rounds of arm/other within each round. Rounds alternate the
    arms' order and a busy box slows every arm of its round alike, so the per-round
    ratio is the steadier estimate; None when no round has both."""
    mine, theirs = agg[arm]["by_round"], agg[other]["by_round"]
    ratios = [mine[k][key] / theirs[k][key] for k in mine.keys() & theirs.keys()
              if key in mine[k] and key in theirs[k] and theirs[k][key]]
    return statistics.median(ratios) if ratios else None


def ratio(agg: dict[str, dict[str, Any]], key: str, other: str,
          arm: str = "ours") -> tuple[float | None, bool]:
    """arm/other of the medians (None when other's is 0: an idle arm at rest), and
    whether it is noise: the two arms' min-max spreads overlap, so the runs cannot
    tell them apart."""
    mine, theirs = agg[arm][key], agg[other][key]
    noise = mine["min"] <= theirs["max"] and theirs["min"] <= mine["max"]
    return (mine["median"] / theirs["median"] if theirs["median"] else None), noise


def table(agg: dict[str, dict[str, Any]]) -> str:
    """Markdown: median (min-max) per arm, ours/other ratios of the medians (``~`` =
    inside the spread) and, over several rounds, ``[median of the per-round ratios]``."""
    arms = [a for a in ARMS if a in agg]
    pairs = [("ours", a) for a in arms if a != "ours"] if "ours" in agg else []
    if "vllm" in agg:  # every other arm against plain vLLM too
        pairs += [(a, "vllm") for a in arms if a not in ("ours", "vllm")]
    lines = ["| metric | " + " | ".join(arms) + "".join(f" | {a}/{o}" for a, o in pairs) + " |",
             "|---" * (1 + len(arms) + len(pairs)) + "|"]
    rows = (*((k, lab) for k, lab, _ in METRICS), ("boot_s", "boot s"),
            ("arm_busy_at_rest_pct", "arm's CPU at rest, % of box"))
    for key, label in (r for r in rows if all(r[0] in agg[a] for a in arms)):
        cells = [f"{agg[a][key]['median']:.2f} ({agg[a][key]['min']:.2f}-"
                 f"{agg[a][key]['max']:.2f})" for a in arms]
        for a, o in pairs:
            value, noise = ratio(agg, key, o, a)
            paired = paired_ratio(agg, key, o, a) if agg[a]["runs"] > 1 else None
            cells.append(("-" if value is None else f"{value:.3f}") + (" ~" if noise else "")
                         + (f" [{paired:.3f}]" if paired is not None else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| failed requests | " + " | ".join(str(agg[a]["failed"]) for a in arms)
                 + " |" * (len(pairs) + 1))
    return "\n".join(lines)


def merge(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """The runs of several result files (one locked job per round), by arm."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in paths:
        for arm, rs in json.loads(path.read_text())["runs"].items():
            runs.setdefault(arm, []).extend(rs)
    return runs
