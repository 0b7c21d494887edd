"""``dsv4-serve plan`` for P/D apps: the KV bytes each request moves, and each pool's capacity.

A decode replica pulls the prompt's KV pages from a prefill replica once per request:
``kv_bytes_per_token x prompt tokens``, rounded up to whole blocks (the connector moves
whole blocks). The per-token figure is the byte model's (``dsv4_patch.rules``: pages
padded, main and indexer caches); the bounded sliding-window and compressor state
(at most a window per layer, independent of the prompt length) comes on top.

Each pool may run its own vLLM (``pd.<pool>.vllm_version``): pools whose releases speak
different NIXL connector versions never complete a handshake, so ``plan`` refuses them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from deployments.config.checks import Finding
from dsv4_patch import rules

PROMPTS = (1024, 8192, 32768)


def summary(args: Any, kv_bytes_per_token: float, block_size: int,
            tokens_per_replica: int | None, max_model_len: int | None,
            release: str) -> dict[str, Any]:
    """Bytes moved per request at a few prompt lengths, both pools' KV capacity and vLLM.

    ``release`` is the vLLM the app is planned with; a pool without its own
    ``vllm_version`` runs it.
    """
    prompts = sorted({p for p in PROMPTS if not max_model_len or p <= max_model_len}
                     | ({max_model_len} if max_model_len else set()))
    moved = {str(p): int(math.ceil(p / block_size) * block_size * kv_bytes_per_token)
             for p in prompts}
    pools = {}
    for name in ("prefill", "decode"):
        replicas = args.pool_deployment_config(name).max_replicas
        own = args.pd.pool(name).vllm_version
        version = args.pool_vllm_version(name, release) or release
        pools[name] = {"max_replicas": replicas, "kv_tokens": None if tokens_per_replica is
                       None else replicas * tokens_per_replica,
                       "vllm_version": version,
                       "vllm_version_from": f"pd.{name}.vllm_version" if own else "the app",
                       "nixl_connector_version":
                           rules.release_rules(version).nixl_connector_version}
    return {"connector": args.pd.kv_transfer_config.get("kv_connector"),
            "bytes_moved_per_request": moved, "pools": pools,
            "compat_check": args.pd.compat_check,
            "canary": args.pd.canary.enabled}


def rows(pd: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Plain-table rows; none for a one-pool app."""
    if not pd:
        return []
    moved = ", ".join(f"{int(p):,} tok {b / 2**20:,.1f} MiB"
                      for p, b in pd["bytes_moved_per_request"].items())
    pools = ", ".join(f"{n} {p['max_replicas']} x "
                      f"{'?' if p['kv_tokens'] is None else format(p['kv_tokens'], ',')} tokens"
                      for n, p in pd["pools"].items())
    return [("P/D connector", f"{pd['connector']} (our compat check "
                              f"{'on' if pd['compat_check'] else 'OFF'})"),
            ("P/D KV moved/req", moved + " (+ bounded SWA/compressor state)"),
            ("P/D pools", pools),
            ("P/D vLLM", ", ".join(
                f"{n} {p['vllm_version']} (NIXL connector {p['nixl_connector_version']}, "
                f"from {p['vllm_version_from']})" for n, p in pd["pools"].items()))]


def problems(pd: dict[str, Any] | None) -> list[Finding]:
    """The pools' vLLM releases: refused when their NIXL connector versions differ."""
    if not pd:
        return []
    prefill, decode = pd["pools"]["prefill"], pd["pools"]["decode"]
    if prefill["vllm_version"] == decode["vllm_version"]:
        return []
    names = (f"prefill pool vLLM {prefill['vllm_version']} (from "
             f"{prefill['vllm_version_from']}), decode pool vLLM {decode['vllm_version']} "
             f"(from {decode['vllm_version_from']})")
    mismatch = rules.nixl_mismatch(prefill["vllm_version"], decode["vllm_version"])
    if mismatch:
        return [Finding("error", "pd-nixl-version", f"{names}: {mismatch[:-1]} (set "
                        "pd.prefill.vllm_version and pd.decode.vllm_version, or "
                        "dsv4.vllm_version alone, to the release both images run).")]
    differing = _rule_differences(prefill["vllm_version"], decode["vllm_version"])
    return [Finding("warning", "pd-vllm-differs", (
        f"{names}: both speak NIXL_CONNECTOR_VERSION {prefill['nixl_connector_version']}, "
        "so the handshake can pass; the DeepSeek rules keyed by release differ in "
        f"{differing or 'nothing'}, and the releases may still differ in what no rule "
        f"tracks. {_runtime(pd['compat_check'])} Fix: run both pools on one vLLM "
        "release."))]


def region_dedup_findings(pd: dict[str, Any] | None) -> list[Finding]:
    """DeepSeek-V4.1 P/D on a release whose NIXL regions dedup by base address alone."""
    if not pd:
        return []
    found = []
    for release in sorted({p["vllm_version"] for p in pd["pools"].values()}):
        hazard = rules.nixl_region_dedup_hazard(release)
        if hazard:
            canary = "on" if pd.get("canary", True) else "OFF: nothing guards it"
            found.append(Finding("warning", "pd-nixl-region-dedup",
                                 f"DeepSeek-V4.1 P/D: {hazard} (pd.canary is {canary})"))
    return found


def _runtime(compat_check: bool) -> str:
    if compat_check:
        return ("The controller's P/D check (pd.compat_check) requires equal vLLM versions, "
                "so no KV pages move between these pools: decode replicas prefill on their "
                "own engines.")
    return ("With pd.compat_check off nothing compares the pools' KV layouts before pages "
            "are copied.")


def _rule_differences(release_a: str, release_b: str) -> list[str]:
    """The fields of ``rules.ReleaseRules`` on which two releases decide differently."""
    a, b = rules.release_rules(release_a), rules.release_rules(release_b)
    return [f.name for f in dataclasses.fields(a)
            if f.name != "since" and getattr(a, f.name) != getattr(b, f.name)]
