"""``dsv4-serve plan`` for P/D apps: the KV bytes each request moves, and each pool's capacity.

A decode replica pulls the prompt's KV pages from a prefill replica once per request:
``kv_bytes_per_token x prompt tokens``, rounded up to whole blocks (the connector moves
whole blocks). The per-token figure is the byte model's (``dsv4_patch.rules``: pages
padded, main and indexer caches); the bounded sliding-window and compressor state
(at most a window per layer, independent of the prompt length) comes on top.
"""

from __future__ import annotations

import math
from typing import Any

PROMPTS = (1024, 8192, 32768)


def summary(args: Any, kv_bytes_per_token: float, block_size: int,
            tokens_per_replica: int | None, max_model_len: int | None) -> dict[str, Any]:
    """Bytes moved per request at a few prompt lengths, and both pools' KV capacity."""
    prompts = sorted({p for p in PROMPTS if not max_model_len or p <= max_model_len}
                     | ({max_model_len} if max_model_len else set()))
    moved = {str(p): int(math.ceil(p / block_size) * block_size * kv_bytes_per_token)
             for p in prompts}
    pools = {}
    for name in ("prefill", "decode"):
        replicas = args.pool_deployment_config(name).max_replicas
        pools[name] = {"max_replicas": replicas, "kv_tokens": None if tokens_per_replica is
                       None else replicas * tokens_per_replica}
    return {"connector": args.pd.kv_transfer_config.get("kv_connector"),
            "bytes_moved_per_request": moved, "pools": pools,
            "compat_check": args.pd.compat_check}


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
            ("P/D pools", pools)]
