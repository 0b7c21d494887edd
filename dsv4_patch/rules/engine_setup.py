"""What vLLM reads to build DeepSeek's KV cache, coerced the way vLLM coerces it.

Its own module because the coercion (vLLM's lax pydantic turns "256" into 256) is a
job apart from the build in ``engine`` that consumes the setup.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineSetup:
    """What vLLM reads to build DeepSeek's KV cache: the node, the release, the engine config."""

    release: str
    platform: str = "cuda"
    capability: tuple[int, int] | None = None
    tp: int = 1
    block_size: int | None = None
    kv_cache_dtype: str | None = None
    attention_backend: str | None = None
    indexer_kv_dtype: str | None = None  # attention_config.indexer_kv_dtype: fp8 | mxfp4
    lora: bool = False
    speculative_method: str | None = None  # speculative_config.method (dspark, mtp, ...)
    num_speculative_tokens: int = 0

    @classmethod
    def from_engine_kwargs(cls, release: str, platform: str,
                           capability: tuple[int, int] | None, node_backend: str | None,
                           engine_kwargs: Mapping[str, Any]) -> EngineSetup:
        """Read what vLLM reads, coerced as vLLM's lax pydantic does ("256" -> 256)."""
        ek = dict(engine_kwargs)
        attn = ek.get("attention_config") or {}
        spec = ek.get("speculative_config") or {}
        backend = ek.get("attention_backend") or attn.get("backend") or node_backend
        return cls(
            release=release, platform=platform, capability=capability,
            tp=_as_int(ek.get("tensor_parallel_size"), "tensor_parallel_size") or 1,
            block_size=_as_int(ek.get("block_size"), "block_size"),
            kv_cache_dtype=_lower(ek.get("kv_cache_dtype")),
            attention_backend=str(backend).upper() if backend else None,
            indexer_kv_dtype=_lower(attn.get("indexer_kv_dtype")),
            lora=bool(ek.get("enable_lora")),
            speculative_method=_lower(spec.get("method")),
            num_speculative_tokens=_as_int(spec.get("num_speculative_tokens"),
                                           "speculative_config.num_speculative_tokens") or 0,
        )


def _as_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected an integer.") from None


def _lower(value: Any) -> str | None:
    return None if value is None else str(value).strip().lower()
