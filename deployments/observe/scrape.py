"""Read a Prometheus scrape of Ray's metrics agent into per-replica figures, for people.

``dsv4-serve status --metrics URL`` prints these; the live test checks the same
figures. Ray's export names are ``series.exported``'s; vLLM's series are tagged
``ReplicaId`` and ours ``replica`` (the same Serve replica id).
"""

from __future__ import annotations

import urllib.request
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from deployments.observe import series

Sample = tuple[dict[str, str], float]


def read(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310  # http URL of a metrics endpoint we name
        return resp.read().decode()


def samples(text: str) -> dict[str, list[Sample]]:
    """Sample name -> [(labels, value)] of a Prometheus text exposition."""
    out: dict[str, list[Sample]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((dict(s.labels), s.value))
    return dict(out)


@dataclass
class ReplicaFigures:
    """What the scrape says about one serving replica."""

    replica: str
    # The labels of its dsv4_kv_replica_info sample: node_type, status (ok|odd), action
    # (serve|drain|fail_health), cache_dtype, fingerprints.
    info: dict[str, str] = field(default_factory=dict)
    kv_bytes_per_token: float | None = None
    kv_capacity_tokens: float | None = None
    kv_usage: float | None = None  # vLLM's kv_cache_usage_perc (0..1)
    generation_tokens: float = 0.0
    in_flight: float | None = None
    stage_seconds: dict[str, tuple[float, float]] = field(default_factory=dict)  # sum, count
    ttft: tuple[float, float] = (0.0, 0.0)  # sum, count
    refused: dict[str, float] = field(default_factory=dict)

    @property
    def node_type(self) -> str | None:
        return self.info.get("node_type")

    @property
    def standing(self) -> str:
        """``", odd: drain"`` for a replica the controller does not let serve as usual."""
        status, action = self.info.get("status") or "ok", self.info.get("action") or "serve"
        return "" if (status, action) == ("ok", "serve") else f", {status}: {action}"

    def mean(self, stage: str) -> float | None:
        total, count = self.stage_seconds.get(stage, (0.0, 0.0))
        return total / count if count else None

    @property
    def ttft_mean(self) -> float | None:
        return self.ttft[0] / self.ttft[1] if self.ttft[1] else None


def _name(s: series.Series, suffix: str = "") -> str:
    return next(n for n in s.exported() if n.endswith(suffix))


def per_replica(scraped: dict[str, list[Sample]], deployment: str | None = None,
                application: str | None = None) -> dict[str, ReplicaFigures]:
    """Figures per live serving replica (``dsv4_kv_replica_info == 1``, or timed requests).

    ``deployment``: the server deployment's name (``llm_deployment`` / Serve's
    ``deployment`` tag); ``application``: Serve's app name (two apps built from one
    config share the deployment name). None = every one.
    """
    out: dict[str, ReplicaFigures] = {}

    def ours(labels: dict[str, str], tag: str) -> bool:
        return ((deployment is None or labels.get(tag) == deployment)
                and (application is None or labels.get("application") == application))

    def fig(replica: str) -> ReplicaFigures:
        return out.setdefault(replica, ReplicaFigures(replica))

    for labels, value in scraped.get(_name(series.REPLICA_INFO), []):
        if value == 1.0 and ours(labels, "llm_deployment"):
            fig(labels["replica"]).info = labels
    for s, attr in ((series.BYTES_PER_TOKEN, "kv_bytes_per_token"),
                    (series.CAPACITY_TOKENS, "kv_capacity_tokens")):
        for labels, value in scraped.get(_name(s), []):
            if labels.get("replica") in out and ours(labels, "llm_deployment"):
                setattr(out[labels["replica"]], attr, value)
    _serving(scraped, out, lambda labels: ours(labels, "deployment"))
    for labels, value in scraped.get("ray_vllm_kv_cache_usage_perc", []):
        if labels.get("ReplicaId") in out:
            out[labels["ReplicaId"]].kv_usage = value
    for labels, value in scraped.get("ray_vllm_generation_tokens_total", []):
        if labels.get("ReplicaId") in out:
            out[labels["ReplicaId"]].generation_tokens += value
    return out


def _serving(scraped: dict[str, list[Sample]], out: dict[str, ReplicaFigures],
             ours: Callable[[dict[str, str]], bool]) -> None:
    """The serving path's series (Serve's ``replica`` tag) into ``out``."""

    def each(name: str) -> list[Sample]:
        return [(lb, v) for lb, v in scraped.get(name, []) if ours(lb) and "replica" in lb]

    # Exact seconds from the counters (Ray estimates a histogram's _sum), counts from
    # the histograms.
    for labels, value in each(_name(series.STAGE_TOTAL)):
        f = out.setdefault(labels["replica"], ReplicaFigures(labels["replica"]))
        total, count = f.stage_seconds.get(labels["stage"], (0.0, 0.0))
        f.stage_seconds[labels["stage"]] = (total + value, count)
    for labels, value in each(_name(series.STAGE, "_count")):
        f = out.setdefault(labels["replica"], ReplicaFigures(labels["replica"]))
        total, count = f.stage_seconds.get(labels["stage"], (0.0, 0.0))
        f.stage_seconds[labels["stage"]] = (total, count + value)
    for labels, value in each(_name(series.TTFT_TOTAL)):
        f = out.setdefault(labels["replica"], ReplicaFigures(labels["replica"]))
        f.ttft = (f.ttft[0] + value, f.ttft[1])
    for labels, value in each(_name(series.TTFT, "_count")):
        f = out.setdefault(labels["replica"], ReplicaFigures(labels["replica"]))
        f.ttft = (f.ttft[0], f.ttft[1] + value)
    for labels, value in each(_name(series.IN_FLIGHT)):
        out.setdefault(labels["replica"], ReplicaFigures(labels["replica"])).in_flight = value
    for labels, value in each(_name(series.REFUSED)):
        f = out.setdefault(labels["replica"], ReplicaFigures(labels["replica"]))
        f.refused[labels["reason"]] = f.refused.get(labels["reason"], 0.0) + value


def describe(figures: dict[str, ReplicaFigures]) -> list[str]:
    """Per replica and per node type, the figures an operator reads first."""
    if not figures:
        return ["  metrics: no dsv4 series in the scrape (is it Ray's metrics agent of a "
                "node that runs the app? Series appear ~10 s after they are set)"]
    lines = ["  metrics (per replica):"]
    for f in sorted(figures.values(), key=lambda f: (f.node_type or "", f.replica)):
        lines.append(
            f"    {f.replica} [{f.node_type or '?'}{f.standing}]: KV {_pct(f.kv_usage)} of "
            f"{_num(f.kv_capacity_tokens)} tokens ({_num(f.kv_bytes_per_token)} B/token), "
            f"{_num(f.generation_tokens)} tokens generated, in flight {_num(f.in_flight)}; "
            f"TTFT {_ms(f.ttft_mean)} = edge {_ms(f.mean('edge'))} + engine "
            f"{_ms(f.mean('engine_first_token'))}"
            + (f"; refused {', '.join(f'{r} {v:.0f}' for r, v in sorted(f.refused.items()))}"
               if f.refused else ""))
    by_type: dict[str, list[ReplicaFigures]] = defaultdict(list)
    for f in figures.values():
        by_type[f.node_type or "?"].append(f)
    lines.append("  metrics (per node type):")
    for node_type, group in sorted(by_type.items()):
        capacity = sum(f.kv_capacity_tokens or 0 for f in group)
        used = sum((f.kv_usage or 0) * (f.kv_capacity_tokens or 0) for f in group)
        lines.append(f"    {node_type}: {len(group)} replica(s), KV {_num(used)} of "
                     f"{_num(capacity)} tokens in use")
    return lines


def _num(value: float | None) -> str:
    return "?" if value is None else f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "?" if value is None else f"{100 * value:.1f}%"


def _ms(value: float | None) -> str:
    return "?" if value is None else f"{1000 * value:.1f} ms"
