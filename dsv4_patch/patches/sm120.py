"""The SM120 validator patch: DeepSeek-V4's FlashInfer sparse backend accepts ``auto`` like fp8."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

from dsv4_patch import rules
from dsv4_patch.patch import Patch, Verdict, mark, original_of

# ------------------------------------------------------------ SM120 validator

SM120_MODULE = "vllm.models.deepseek_v4.nvidia.flashinfer_sparse"
SM120_CLASS = "DeepseekV4FlashInferMLASparseBackend"


def _sm120_probe_args(function: Callable[..., Any]) -> dict[str, Any]:
    """Keyword arguments for an SM120 ``auto`` query, by parameter name.

    Raises TypeError when the validator has a required parameter we cannot fill.
    """
    import torch
    from vllm.platforms.interface import DeviceCapability

    known = {"head_size": 512, "dtype": torch.bfloat16, "kv_cache_dtype": "auto",
             "block_size": 256, "use_mla": True, "has_sink": True, "use_sparse": True,
             "use_mm_prefix": False, "device_capability": DeviceCapability(12, 0)}
    params = list(inspect.signature(function).parameters.values())[1:]  # after cls
    unknown = [p.name for p in params if p.name not in known and p.default is p.empty]
    if unknown or not {"kv_cache_dtype", "device_capability"} <= {p.name for p in params}:
        raise TypeError(f"validator parameters {[p.name for p in params]} are not the "
                        "known (head_size, ..., kv_cache_dtype, ..., device_capability)")
    return {p.name: known[p.name] for p in params if p.name in known}


def _probe_sm120(module: ModuleType) -> Verdict:
    backend = getattr(module, SM120_CLASS, None)
    if backend is None:
        return Verdict(False, f"{SM120_MODULE}.{SM120_CLASS} not in this vLLM")
    own = vars(backend).get("supports_combination")
    if own is None:
        return Verdict(False, f"{SM120_CLASS} inherits a generic supports_combination "
                       "(no DeepSeek-V4 dtype check on SM12x in this vLLM)")
    function = own.__func__
    if original_of(function) is not function:  # probe vLLM's own validator, not ours
        function = original_of(function).__func__
    verdict = function(backend, **_sm120_probe_args(function))
    if verdict is not None and "kv_cache_dtype" in verdict:
        return Verdict(True, f"SM120 validator rejects auto ({verdict!r})")
    return Verdict(False, "SM120 validator already accepts auto")


def _patch_sm120(module: ModuleType) -> str:
    backend = getattr(module, SM120_CLASS)
    original = vars(backend)["supports_combination"]
    signature = inspect.signature(original.__func__)

    def supports_combination(cls: type, *args: Any, **kwargs: Any) -> str | None:
        bound = signature.bind(cls, *args, **kwargs)
        capability = bound.arguments.get("device_capability")
        if capability is not None and capability.major == 12:
            if bound.arguments.get("kv_cache_dtype") in rules.AUTO_VALUES:
                bound.arguments["kv_cache_dtype"] = "fp8"
        return original.__func__(*bound.args, **bound.kwargs)

    backend.supports_combination = classmethod(mark(supports_combination, original))
    return "auto now checked as fp8 on SM12x"


SM120_PATCH = Patch(
    name="dsv4.sm120_validator_accepts_auto",
    module=SM120_MODULE,
    target=f"{SM120_MODULE}.{SM120_CLASS}.supports_combination",
    why=(
        "On SM12x the DSv4 FlashInfer sparse backend stores fp8_ds_mla, yet its validator "
        "refuses kv_cache_dtype='auto', so the default config is rejected at backend selection."
    ),
    how=(
        "Probe the class's own validator with an SM12x auto query (arguments by parameter "
        "name; a class without its own validator, as in 0.23.0, is left alone); on 12.x, "
        "validate auto/None as fp8 (what the resolver turns them into)."
    ),
    upstream="vllm-project/vllm#55134 (relaxes the validator; closed as duplicate of #45091)",
    affected="vLLM 0.24.0-0.33.x (validator present and refusing auto)",
    remove_when="the validator accepts auto upstream (probe reports skipped)",
    probe=_probe_sm120,
    change=_patch_sm120,
)
