"""Test fixture: dummy weights at fan-in scale instead of vLLM's U(-1e-3, 1e-3).

vLLM's dummy loader draws every float tensor from U(-1e-3, 1e-3), RMSNorm gains
included. Through DeepSeek-V4's stacked projections the attention and MoE updates
end up ~1e-6 of the bf16 residual and round away: the model turns unigram (each
output depends on the current token only) and no test of attention, the KV cache
or batching could fail. Re-randomizing after loading is too late on CPU: vLLM has
already packed the linear weights into its GEMM handles. So the loader's own
per-tensor initializer is wrapped, in the worker process, before it runs:
>=2-D float tensors -> U(+-sqrt(3 / fan_in)), 1-D -> U(0.5, 1.5) (gains near 1),
from one seeded generator, so every process loads the same weights.
"""

from __future__ import annotations

import functools
from typing import Any

DUMMY_LOADER_MODULE = "vllm.model_executor.model_loader.dummy_loader"
SEED = 1234


def scaled(original: Any) -> Any:
    """Wrap vLLM's ``initialize_single_dummy_weight``; defer to it where it is special."""
    import torch

    gen = torch.Generator().manual_seed(SEED)

    @functools.wraps(original)
    def initialize(param: Any, *args: Any, **kwargs: Any) -> None:
        special = param.device.type == "meta" or not torch.is_floating_point(param)
        if special or getattr(param, "dummy_weight_value", None) is not None:
            original(param, *args, **kwargs)
            return
        if param.dim() >= 2:
            bound = (3.0 / param.shape[-1]) ** 0.5
            values = (torch.rand(param.shape, generator=gen) * 2 - 1) * bound
        else:
            values = torch.rand(param.shape, generator=gen) + 0.5
        with torch.no_grad():
            param.copy_(values.to(param.dtype))

    return initialize


def install_into(module: Any) -> None:  # vLLM's dummy loader module
    """Replace the dummy loader's initializer (it imported the function by name)."""
    module.initialize_single_dummy_weight = scaled(module.initialize_single_dummy_weight)
