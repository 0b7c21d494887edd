"""One tiny-DeepSeek-V4 engine over two CPU worker processes (TP 2 or PP 2), as a script.

Run as ``python -m tests.parallel_engine --tp 2`` (or ``--pp 2``, optionally with
``--hf-overrides JSON``): a fresh interpreter, because vLLM spawns its engine core
and workers and the plugin must reach them the way it reaches a user's. Prints one
``DSV4_PARALLEL_RESULT`` JSON line (boot seconds, tokens generated, each worker's KV
specs) or dies with vLLM's own error. ``tests/test_deployments/test_cpu_multinode_limits.py``
reads both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--hf-overrides", default="{}")
    args = parser.parse_args()
    from dsv4_patch import tiny_model

    for key, value in tiny_model.CPU_ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(**tiny_model.cpu_engine_kwargs(
        tiny_model.ensure_tiny_model(), tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp, distributed_executor_backend="mp", max_num_seqs=4,
        hf_overrides=json.loads(args.hf_overrides),
        worker_extension_cls="dsv4_patch.worker_ext.DSv4WorkerExtension"))
    boot_s = time.monotonic() - started
    try:
        workers = llm.collective_rpc("dsv4_kv_specs")
        out = llm.generate(["hello world"], SamplingParams(max_tokens=8, temperature=0,
                                                           ignore_eos=True))
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=30)
    result = {"boot_s": round(boot_s, 1), "tokens": len(out[0].outputs[0].token_ids),
              "workers": workers}
    sys.stdout.write("DSV4_PARALLEL_RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # the engine is already shut down; skip the slow interpreter teardown


if __name__ == "__main__":
    main()
