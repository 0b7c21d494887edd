"""Import a released vLLM's real DeepSeek-V4 modules and call their real dtype decision.

Run as ``python -m tests.releases.imports VERSION on|off`` with the release's overlay
first on PYTHONPATH (tests/releases/venvs.py); ``on`` loads the general plugins the way
vLLM does (``vllm.plugins.load_general_plugins``), ``off`` runs with ``VLLM_PLUGINS=""``. Prints one
``DSV4_IMPORT {...}`` line: what imported, the doctor's probes, the plugin record,
and the real code's decisions against upstream 0.30+ (``resolver_mismatches``).

0.20-0.22 decide in ``DeepseekV4MLAAttention.__init__``: it is called for real with a
real ``CacheConfig``. Two things are replaced for that call, both read before the dtype
check and unrelated to it: ``torch.cuda.Event`` (CPU torch cannot create one) by a
no-op class, and the module's ``get_current_vllm_config`` (no engine is running) by an
object holding the three values the layer reads.
"""

from __future__ import annotations

import importlib
import json
import sys
from types import SimpleNamespace
from typing import Any

from dsv4_patch.patches.kv_dtype import RESOLVER_NAME, call_resolver, resolver_mismatches

LEGACY_LAYER = "vllm.model_executor.layers.deepseek_v4_attention"
ATTENTION = "vllm.models.deepseek_v4.attention"
MODEL = "vllm.models.deepseek_v4"


def _try(call: Any) -> tuple[Any, str | None]:
    try:
        return call(), None
    except Exception as exc:  # reported: the release's own outcome is the datum
        return None, f"{type(exc).__name__}: {exc}"


class _NoEvent:
    """``torch.cuda.Event`` for CPU torch (the layer only stores two of them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def _config() -> SimpleNamespace:
    """The three config values the layer reads besides ``cache_config`` (no engine here)."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=2048),
        model_config=SimpleNamespace(max_model_len=1024),
        compilation_config=SimpleNamespace(static_forward_context={}))


def layer_decision(module: Any, dtype: str) -> dict[str, Any]:
    """Construct the real 0.20-0.22 layer with ``cache_dtype=dtype``; what it decided."""
    import torch
    from vllm.config import CacheConfig

    config = CacheConfig()
    config.cache_dtype = dtype  # bypass validation: garbage must reach the layer too
    kwargs = dict(num_heads=64, head_dim=512, scale=1.0, qk_nope_head_dim=448,
                  qk_rope_head_dim=64, q_lora_rank=None, kv_lora_rank=512, compress_ratio=4,
                  window_size=128, head_bytes=584, swa_cache_layer=object(),
                  attn_sink=torch.zeros(64), cache_config=config, prefix="")
    real_event, torch.cuda.Event = torch.cuda.Event, _NoEvent
    real_config, module.get_current_vllm_config = module.get_current_vllm_config, _config
    try:
        layer, error = _try(lambda: module.DeepseekV4MLAAttention(**kwargs))
    finally:
        torch.cuda.Event, module.get_current_vllm_config = real_event, real_config
    return {"kv_cache_dtype": getattr(layer, "kv_cache_dtype", None), "error": error,
            "cache_config_after": config.cache_dtype}


def main(version: str, plugin: bool) -> dict[str, Any]:
    import vllm

    from dsv4_patch import doctor, record
    from dsv4_patch.import_hooks import module_exists

    out: dict[str, Any] = {"version": version, "plugin": plugin,
                           "vllm_file": vllm.__file__}
    if plugin:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    out["doctor"] = None
    legacy = module_exists(LEGACY_LAYER)
    name = LEGACY_LAYER if legacy else ATTENTION
    module, out["import_attention"] = _try(lambda: importlib.import_module(name))
    if not legacy:
        _, out["import_model"] = _try(lambda: importlib.import_module(f"{MODEL}.nvidia.model"))
    if module is not None:
        resolver = getattr(module, RESOLVER_NAME, None)
        if resolver is not None:
            out["kind"] = "resolver"
            out["mismatches"] = resolver_mismatches(resolver, (True, False))
            out["auto"] = call_resolver(resolver, True, "auto").__dict__
            out["bfloat16"] = call_resolver(resolver, True, "bfloat16").__dict__
        else:
            out["kind"] = "layer"
            out["auto"] = layer_decision(module, "auto")
            out["bfloat16"] = layer_decision(module, "bfloat16")
            out["fp8_e5m2"] = layer_decision(module, "fp8_e5m2")
    out["doctor"] = doctor.probe_patches()
    rec = record.current()
    out["record"] = rec.as_dict() if rec is not None else None
    return out


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2] == "on")
    sys.stdout.write("DSV4_IMPORT " + json.dumps(result, default=str) + "\n")
