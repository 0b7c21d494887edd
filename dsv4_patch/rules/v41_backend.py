"""V4.1's attention backend on one node, as vLLM ``release`` selects it.

Mirrors ``deepseek_v41/nvidia/model.py::_select_dsv4_attn_cls`` (and ``amd/model.py``),
the kernel-availability check of mega attention
(``FlashMLAMegaAttnAttention.is_available_for``) and the backends' capability checks;
``engine.build`` composes it with the block size and page arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsv4_patch.rules.engine_setup import EngineSetup
from dsv4_patch.rules.family import (
    FLASHINFER_V41,
    FLASHMLA_V41,
    FP8_DS_MLA,
    MEGA_V41,
    NVFP4_DS_MLA,
    WV_GROUP_SIZE,
)
from dsv4_patch.rules.layouts import LayoutError
from dsv4_patch.rules.model_config import flatten_config
from dsv4_patch.rules.releases import ReleaseRules, release_rules

_REFUSED_V41 = ("FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120")
_FLASHINFER_V41_NAMES = ("FLASHINFER_MLA_SPARSE_DSV4", FLASHINFER_V41)
_FLASHMLA_V41_NAMES = ("FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4", FLASHMLA_V41)
# supports_compute_capability of each V4.1 CUDA backend (majors).
_V41_MAJORS = {FLASHMLA_V41: (9, 10), MEGA_V41: (10,), FLASHINFER_V41: (10, 12)}


def mega_fits(hf_config: Mapping[str, Any], tp: int) -> bool:
    """``is_available_for``'s topology test: 8 local heads per local ``wo_a`` group."""
    flat = flatten_config(hf_config)
    heads, groups = int(flat.get("num_attention_heads") or 0), int(flat.get("o_groups") or 0)
    if tp < 1 or heads % tp or groups % tp:
        return False
    local_heads, local_groups = heads // tp, groups // tp
    if not local_groups or local_heads % WV_GROUP_SIZE:
        return False
    return local_heads // local_groups == WV_GROUP_SIZE


@dataclass(frozen=True)
class V41Choice:
    """The V4.1 attention class's backend, layout and preferred packed dtype on one node."""

    backend: str
    packed: bool
    preferred: str
    reason: str


def v41_attention(setup: EngineSetup, fits: bool) -> V41Choice:
    """``_select_dsv4_attn_cls`` of ``setup.release`` and the chosen backend's capability check."""
    rel = release_rules(setup.release)
    unknown = _unknown_backend(setup, rel)
    if unknown:
        raise LayoutError(f"attention_backend={unknown}: vLLM {setup.release} has no such "
                          "attention backend; unset attention_backend.")
    if setup.platform == "rocm":
        accepted = ("ROCM_FLASHMLA_SPARSE_DSV4", rel.v41_rocm_backend)
        if setup.attention_backend not in (None, *accepted):
            raise LayoutError(f"attention_backend={setup.attention_backend} is not supported "
                              f"for DeepSeek V4.1 on ROCm by vLLM {setup.release}; use "
                              f"{rel.v41_rocm_backend} or leave it unset.")
        return V41Choice(rel.v41_rocm_backend, True, FP8_DS_MLA, "ROCm: aiter, V4 record")
    if setup.platform != "cuda":
        raise LayoutError(
            f"platform={setup.platform!r}: vLLM has no DeepSeek-V4.1 path there (no "
            "models/deepseek_v41/cpu; the nvidia classes need CUDA streams). Fix: serve "
            "V4.1 on CUDA (SM90/SM100/SM120) or ROCm nodes, or serve DeepSeek-V4 on CPU.")
    choice = _cuda_v41_choice(setup, rel, fits)
    cap = setup.capability
    majors = _V41_MAJORS[choice.backend]
    if cap and cap[0] not in majors:
        raise LayoutError(
            f"attention backend {choice.backend} supports compute capability "
            f"{' and '.join(f'{m}.x' for m in majors)} only, got "
            f"{cap[0]}.{cap[1]}; "
            "unset attention_backend (or pick one this GPU runs).")
    return choice


def _unknown_backend(setup: EngineSetup, rel: ReleaseRules) -> str | None:
    """A V4.1 backend name this release's ``AttentionBackendEnum`` does not have."""
    missing = {MEGA_V41: not rel.v41_mega,
               "ROCM_FLASHMLA_SPARSE_DSV41": rel.v41_rocm_backend != "ROCM_FLASHMLA_SPARSE_DSV41"}
    name = setup.attention_backend
    return name if name and missing.get(name) else None


def _cuda_v41_choice(setup: EngineSetup, rel: ReleaseRules, fits: bool) -> V41Choice:
    name = setup.attention_backend
    major = setup.capability[0] if setup.capability else None
    lora_off = setup.lora and rel.v41_lora_disables_mega
    if name in _REFUSED_V41:
        raise LayoutError(f"attention_backend={name} is not a DeepSeek-V4.1 backend; use "
                          f"{FLASHINFER_V41} (or leave it unset for the default).")
    if name in _FLASHINFER_V41_NAMES:
        if major == 12:
            return V41Choice(FLASHINFER_V41, True, FP8_DS_MLA, "SM12x FlashInfer, packed V4 record")
        return V41Choice(FLASHINFER_V41, False, "bfloat16", "FlashInfer DSv4.1: plain KV rows")
    if name == MEGA_V41:
        if lora_off:
            return V41Choice(FLASHMLA_V41, True, FP8_DS_MLA,
                             f"LoRA: vLLM {setup.release} builds FlashMLA instead of mega")
        if major == 10 and not fits:
            raise LayoutError(f"attention_backend={name} needs {WV_GROUP_SIZE} local heads "
                              "per wo_a group (num_attention_heads/TP over o_groups/TP); "
                              "unset attention_backend or change tensor_parallel_size.")
        return V41Choice(MEGA_V41, True, NVFP4_DS_MLA, "FlashMLA mega (vllm#56935)")
    if name in _FLASHMLA_V41_NAMES:
        return V41Choice(FLASHMLA_V41, True, FP8_DS_MLA, "FlashMLA sparse, packed record")
    # Any other name: vLLM's V4.1 CUDA selector does not read it and takes its default.
    if major == 12:
        return V41Choice(FLASHINFER_V41, True, FP8_DS_MLA, "SM12x default: FlashInfer, packed")
    if major == 10 and rel.v41_mega and not lora_off and fits:
        return V41Choice(MEGA_V41, True, NVFP4_DS_MLA,
                         "SM100 default: FlashMLA mega, NVFP4 compressed cache (vllm#56935)")
    why = ("LoRA turns mega attention off" if major == 10 and rel.v41_mega and lora_off else
           "the heads per wo_a group rule mega out" if major == 10 and rel.v41_mega else
           "default")
    return V41Choice(FLASHMLA_V41, True, FP8_DS_MLA, f"FlashMLA sparse ({why})")
