"""Test hook: print a worker's KV cache specs and plugin record as vLLM collects them.

vLLM calls ``GPUModelRunner.get_kv_cache_spec`` (the CPU runner inherits it) once the
model's layers are built and before the memory-profiling forward pass. On releases
that stop at the first forward (0.27-0.29 on CPU: CUDA-only ``o_proj``) that is the
last moment the layers' decisions can be read; the line goes to stderr, which the
engine core inherits from the test's subprocess.
"""

from __future__ import annotations

import functools
import json
import sys
from types import ModuleType
from typing import Any

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
MARK = "DSV4_SPECS "


def install_into(module: ModuleType) -> None:
    from dsv4_patch import record
    from dsv4_patch.worker_ext import spec_to_dict

    runner = module.GPUModelRunner
    original = runner.get_kv_cache_spec

    @functools.wraps(original)
    def get_kv_cache_spec(self: Any) -> Any:
        specs = original(self)
        rec = record.current()
        line = {"specs": [spec_to_dict(name, spec) for name, spec in specs.items()],
                "record": rec.as_dict() if rec is not None else None}
        sys.stderr.write(MARK + json.dumps(line) + "\n")
        sys.stderr.flush()
        return specs

    runner.get_kv_cache_spec = get_kv_cache_spec
