"""Why a CPU replica cannot span two nodes here, proved on the installed wheels.

Pro's shape is one engine over two nodes: vLLM's Ray executor, pipeline parallel
2. On CPU both halves refuse: vLLM's CPU platform has no Ray device key, so its
Ray executor raises; Ray Serve LLM runs every CPU engine with the multiprocess
executor whatever ``distributed_executor_backend`` says. These tests fail the
day either changes -- then the PP-across-nodes replica can run here. Until then
the config rejects what would be ignored (never accept a setting and ignore it).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.config import DEFAULT_CONFIG, ConfigError, parse_app_args
from tests.support import engine_boot


def _local_args() -> dict:
    return copy.deepcopy(yaml.safe_load(DEFAULT_CONFIG.read_text())["applications"][0]["args"])


def test_vllm_cpu_has_no_ray_executor() -> None:
    import inspect

    from vllm.platforms import current_platform
    from vllm.v1.executor import ray_utils

    assert current_platform.device_name == "cpu"
    assert current_platform.ray_device_key == ""
    # initialize_ray_cluster (the Ray executor's first step) refuses an empty device key
    # with "current platform cpu does not support ray" (after connecting to Ray, so the
    # check is read here rather than run).
    source = inspect.getsource(ray_utils.initialize_ray_cluster)
    assert "if not device_str:" in source and "does not support ray" in source


def test_ray_serve_llm_forces_the_mp_executor_on_cpu() -> None:
    from ray.serve.llm import LLMConfig

    data = parse_app_args(_local_args()).llm_config_dict()
    data["engine_kwargs"] |= {"distributed_executor_backend": "ray",
                              "pipeline_parallel_size": 2}
    engine = LLMConfig(**data).get_engine_config()
    assert engine.get_initialization_kwargs()["distributed_executor_backend"] == "mp"


@pytest.mark.parametrize(("where", "value", "named"), [
    ("engine", {"distributed_executor_backend": "ray"}, "distributed_executor_backend"),
    ("node", {"nodes_per_replica": 2}, "nodes_per_replica"),
    ("engine", {"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
])
def test_config_rejects_a_cpu_replica_across_nodes(where: str, value: dict,
                                                   named: str) -> None:
    args = _local_args()
    target = args["llm"]["engine_kwargs"] if where == "engine" else args["dsv4"]["node"]
    target.update(value)
    with pytest.raises(ConfigError) as err:
        parse_app_args(args)
    assert named in str(err.value) and "Fix:" in str(err.value)


# ---- the nearest real thing: one engine over two worker processes on one node --------

REPO = Path(__file__).resolve().parents[2]
# Every cache group on both stages: two copies of the tiny model's layer mix.
EIGHT_LAYERS = {"num_hidden_layers": 8, "compress_ratios": [0, 4, 128, 4, 0, 4, 128, 4, 0]}


def _parallel_engine(*args: str) -> subprocess.CompletedProcess[str]:
    """``tests.support.engine_boot`` on the tiny model with ``args`` (8 greedy tokens, 4 seqs)."""
    from dsv4_patch.tiny_model import ensure_tiny_model

    return subprocess.run([sys.executable, "-m", "tests.support.engine_boot",
                           str(ensure_tiny_model()), "--generate", "8", "--max-num-seqs", "4",
                           *args], cwd=REPO,
                          capture_output=True, text=True, timeout=420)


@pytest.mark.slow
def test_tp2_engine_spans_two_workers_each_on_fp8_ds_mla_and_generates() -> None:
    """Pro's multi-node shape needs one engine over several workers; on CPU the nearest
    that runs is TP 2 over two worker processes of one node, the plugin in both."""
    proc = _parallel_engine("--tp", "2")
    result = engine_boot.result_of(proc.stdout)
    assert result is not None, proc.stderr[-4000:]
    print(f"TP 2 on CPU: boot {result['boot_seconds']} s, {result['tokens']} tokens")
    assert result["tokens"] == 8
    assert sorted(w["rank"] for w in result["workers"]) == [0, 1]
    for worker in result["workers"]:
        dtypes = {s["cache_dtype_str"] for s in worker["specs"] if "attn" in s["layer"]
                  and "indexer" not in s["layer"] and "compressor" not in s["layer"]}
        assert dtypes == {"fp8_ds_mla"}, (worker["rank"], dtypes)


# Two engine attempts that only change with the vllm-cpu pin: `make test-releases`, so
# CI's budget holds the P/D canary's engine pair instead.
@pytest.mark.slow
@pytest.mark.releases
@pytest.mark.parametrize(("overrides", "upstream_error"), [
    # The tiny model split 2/2: stage 0 owns no compress-128 layer (vllm#54711).
    ({}, "StopIteration"),
    # Every group on both stages: boots, stage 1's first forward finds no inputs.
    (EIGHT_LAYERS, "assert self.intermediate_tensors is not None"),
])
def test_pp2_on_cpu_fails_in_vllm(overrides: dict, upstream_error: str) -> None:
    """Why the config refuses pipeline_parallel_size > 1 on CPU. Fails the day vLLM's CPU
    engine runs DeepSeek-V4 in two stages: then lift the refusal in checks.py."""
    proc = _parallel_engine("--pp", "2", "--hf-overrides", json.dumps(overrides))
    assert proc.returncode != 0 and engine_boot.RESULT not in proc.stdout
    assert upstream_error in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-4000:]
