"""Boot a real vLLM engine on the tiny DeepSeek-V4 and print what its workers report.

Run as ``python -m tests.engine_boot MODEL_DIR``: a fresh interpreter, so the
environment (``VLLM_PLUGINS``, the legacy-resolver ``sitecustomize``) reaches the
engine core and worker processes exactly as it would for a user. Prints one JSON
line: boot seconds, the workers' KV specs and patch records. Used by the
end-to-end tests and by the patch-cost benchmark.
"""

from __future__ import annotations

import json
import os
import sys
import time

CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


def boot(model: str) -> dict[str, object]:
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    start = time.monotonic()
    llm = LLM(
        model=model,
        load_format="dummy",
        kv_cache_dtype="auto",
        enforce_eager=True,
        max_model_len=4096,
        max_num_seqs=8,
        worker_extension_cls="dsv4_patch.worker_ext.DSv4WorkerExtension",
    )
    boot_s = time.monotonic() - start
    try:
        workers = llm.collective_rpc("dsv4_kv_specs")
    finally:
        # The engine core is a separate process that outlives os._exit; stop it.
        llm.llm_engine.engine_core.shutdown(timeout=30)
    return {
        "boot_seconds": round(boot_s, 2),
        "frontend_cache_dtype": llm.llm_engine.vllm_config.cache_config.cache_dtype,
        "workers": workers,
    }


if __name__ == "__main__":
    result = boot(sys.argv[1])
    sys.stdout.write("DSV4_BOOT_RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # engine already shut down; skip the slow interpreter teardown
