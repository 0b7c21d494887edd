"""Test hook: print what a worker's DeepSeek-V4 layers decided, and its plugin record.

Two moments, each one stderr line (the engine core and workers inherit the test's):

* ``DSV4_LAYER``: right after ``DeepseekV4Attention.__init__`` (0.23+; the layer base
  that runs the resolver and builds the SWA cache) returns: the layer's own
  ``kv_cache_dtype``. On 0.27-0.29 on CPU that is the last moment: the FlashMLA
  subclass ``__init__`` then computes its CUDA-only ``o_proj`` recipe
  (``compute_fp8_einsum_recipe`` asserts a CUDA device) and the worker dies.
* ``DSV4_SPECS``: ``GPUModelRunner.get_kv_cache_spec`` (the CPU runner inherits it),
  once every layer is built and before the memory-profiling forward pass.
"""

from __future__ import annotations

import functools
import json
import sys
from types import ModuleType
from typing import Any

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
ATTENTION_MODULE = "vllm.models.deepseek_v4.attention"
MARK = "DSV4_SPECS "
LAYER_MARK = "DSV4_LAYER "


def _record() -> dict | None:
    from dsv4_patch import record

    rec = record.current()
    return rec.as_dict() if rec is not None else None


def install_layer_report(module: ModuleType) -> None:
    """Wrap ``DeepseekV4Attention.__init__`` to print the decision once it returns."""
    cls = getattr(module, "DeepseekV4Attention", None)
    if cls is None:  # 0.20-0.22: no such base class
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        line = {"prefix": getattr(self, "prefix", None),
                "kv_cache_dtype": getattr(self, "kv_cache_dtype", None),
                "compress_ratio": getattr(self, "compress_ratio", None), "record": _record()}
        sys.stderr.write(LAYER_MARK + json.dumps(line) + "\n")
        sys.stderr.flush()

    cls.__init__ = __init__


def install_into(module: ModuleType) -> None:
    from dsv4_patch.worker_ext import spec_to_dict

    runner = module.GPUModelRunner
    original = runner.get_kv_cache_spec

    @functools.wraps(original)
    def get_kv_cache_spec(self: Any) -> Any:
        specs = original(self)
        line = {"specs": [spec_to_dict(name, spec) for name, spec in specs.items()],
                "record": _record()}
        sys.stderr.write(MARK + json.dumps(line) + "\n")
        sys.stderr.flush()
        return specs

    runner.get_kv_cache_spec = get_kv_cache_spec
