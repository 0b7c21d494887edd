"""Boot a real vLLM engine on the tiny DeepSeek-V4 and print what its workers report.

Run as ``python -m tests.support.engine_boot MODEL_DIR [--tp N] [--pp N] [--hf-overrides JSON]
[--generate TOKENS]``: a fresh interpreter, so the environment (``VLLM_PLUGINS``, the
legacy-resolver ``sitecustomize``) reaches the engine core and worker processes exactly
as it would for a user. Prints one ``DSV4_BOOT_RESULT`` JSON line (boot seconds, the
workers' KV specs and patch records, and with ``--generate`` the tokens one greedy
request produced) or dies with vLLM's own error. The one engine harness of the
end-to-end tests: one worker, TP 2, PP 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

RESULT = "DSV4_BOOT_RESULT"


def result_of(stdout: str) -> dict[str, Any] | None:
    """The ``RESULT`` line a run printed, parsed; None when it printed none (it died)."""
    for line in stdout.splitlines():
        if line.startswith(RESULT + " "):
            return json.loads(line.split(" ", 1)[1])
    return None


def boot(model: str, tp: int = 1, pp: int = 1, hf_overrides: dict[str, Any] | None = None,
         generate: int = 0, max_num_seqs: int = 8) -> dict[str, object]:
    """Boot, ask every worker for its KV specs, optionally generate, shut down."""
    from dsv4_patch import tiny_model

    for key, value in tiny_model.CPU_ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    parallel: dict[str, Any] = {}
    if tp * pp > 1:  # several workers: vLLM's multiprocess executor, as Ray Serve LLM uses
        parallel = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                    "distributed_executor_backend": "mp"}
    start = time.monotonic()
    llm = LLM(**tiny_model.cpu_engine_kwargs(
        model, max_num_seqs=max_num_seqs, hf_overrides=hf_overrides or {},
        worker_extension_cls="dsv4_patch.worker_ext.DSv4WorkerExtension", **parallel))
    boot_s = time.monotonic() - start
    result: dict[str, object] = {
        "boot_seconds": round(boot_s, 2),
        "frontend_cache_dtype": llm.llm_engine.vllm_config.cache_config.cache_dtype,
    }
    try:
        result["workers"] = llm.collective_rpc("dsv4_kv_specs")
        if generate:
            out = llm.generate(["hello world"], SamplingParams(
                max_tokens=generate, temperature=0, ignore_eos=True))
            result["tokens"] = len(out[0].outputs[0].token_ids)
    finally:
        # The engine core is a separate process that outlives os._exit; stop it.
        llm.llm_engine.engine_core.shutdown(timeout=30)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--hf-overrides", default="{}", help="JSON, vLLM's hf_overrides")
    parser.add_argument("--generate", type=int, default=0, help="tokens of one greedy request")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    args = parser.parse_args()
    result = boot(args.model, args.tp, args.pp, json.loads(args.hf_overrides), args.generate,
                  args.max_num_seqs)
    sys.stdout.write(f"{RESULT} {json.dumps(result)}\n")
    sys.stdout.flush()
    os._exit(0)  # engine already shut down; skip the slow interpreter teardown


if __name__ == "__main__":
    main()
