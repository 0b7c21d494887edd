"""Config validation: wrong configs fail before Ray starts, naming field, value and fix."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments.config import (
    DEFAULT_CONFIG,
    WORKER_EXTENSION,
    ConfigError,
    load_serve_config,
    parse_app_args,
)


def local_args() -> dict[str, Any]:
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    return copy.deepcopy(raw["applications"][0]["args"])


def set_path(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    *parents, last = dotted.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return data


def test_local_cpu_config_is_valid() -> None:
    config = load_serve_config(DEFAULT_CONFIG)
    [(app, args)] = config.ours()
    assert app.route_prefix == "/"
    assert args.llm.engine_kwargs.kv_cache_dtype == "auto"
    assert args.dsv4.policy.value == "enforce"
    assert args.llm.deployment_config.autoscaling_config.min_replicas == 2  # type: ignore[union-attr]  # set in that config
    llm = args.llm_config_dict("/models/tiny")
    assert llm["model_loading_config"]["model_source"] == "/models/tiny"
    assert llm["engine_kwargs"]["worker_extension_cls"] == WORKER_EXTENSION
    assert llm["engine_kwargs"]["kv_cache_dtype"] == "auto"  # the replica resolves it


# (dotted field, bad value, fragments the message must contain)
BAD = [
    ("dsv4.policy", "enforcing", ["dsv4.policy", "'enforcing'", "enforce", "warn"]),
    ("llm.engine_kwargs.kv_cache_dtype", "bfloat16",
     ["llm.engine_kwargs.kv_cache_dtype", "'bfloat16'", "fp8_ds_mla", "Fix"]),
    ("dsv4.expected_layout", "plain_rows",
     ["dsv4.expected_layout", "'plain_rows'", "fp8_ds_mla", "Fix"]),
    ("llm.deployment_config.autoscaling_config.min_replicas", 3,
     ["min_replicas=3", "max_replicas=2", "Fix"]),
    ("llm.runtime_env.env_vars.VLLM_CPU_KVCACHE_SPACE", 1,
     ["VLLM_CPU_KVCACHE_SPACE=1", "strings", "Fix"]),
    ("llm.runtime_env.env_vars.VLLM_PLUGINS", "other_plugin",
     ["VLLM_PLUGINS='other_plugin'", "dsv4_patch", "Fix"]),
    ("llm.engine_kwargs.worker_extension_cls", "my.Ext",
     ["worker_extension_cls='my.Ext'", WORKER_EXTENSION, "Fix"]),
    ("llm.placement_group_config.bundles", [{"CPU": 1, "GPU": 1}],
     ["bundles", "GPU", "platform='cpu'", "Fix"]),
    ("dsv4.node.platform", "tpu", ["dsv4.node.platform", "'tpu'"]),
    ("llm.engine_kwargs.data_parallel_size", 2, ["data_parallel_size=2", "autoscaling", "Fix"]),
    ("dsv4.replica_overrides", [{"rank": 5, "engine_kwargs": {"enforce_eager": False}}],
     ["replica_overrides[0].rank=5", "ranks 0..1", "Fix"]),
    ("dsv4.replica_overrides", [{"rank": 1, "engine_kwargs": {"block_size": 64}}],
     ["replica_overrides[0].engine_kwargs.block_size=64", "CPU", "256", "Fix"]),
    ("llm.engine_kwargs.block_size", 128, ["block_size=128", "CPU", "256", "Fix"]),
    ("llm.deployment_config.num_replicas", 2, ["num_replicas=2", "autoscaling_config", "Fix"]),
    ("llm.model_loading_config.model_idd", "x", ["model_idd", "unknown key"]),
]


@pytest.mark.parametrize(("field", "value", "fragments"), BAD, ids=[b[0] for b in BAD])
def test_bad_config_names_field_value_and_fix(field: str, value: Any,
                                             fragments: list[str]) -> None:
    args = set_path(local_args(), field, value)
    with pytest.raises(ConfigError) as info:
        parse_app_args(args)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from:\n{message}"


def test_gpu_node_needs_one_gpu_bundle_per_worker() -> None:
    args = local_args()
    args["dsv4"]["node"] = {"platform": "cuda", "compute_capability": "9.0"}
    args["llm"]["engine_kwargs"]["tensor_parallel_size"] = 8
    args["llm"]["placement_group_config"] = {"bundles": [{"GPU": 1, "CPU": 4}] * 4}
    with pytest.raises(ConfigError, match=r"4 bundle\(s\).*expected 8 bundles of GPU: 1"):
        parse_app_args(args)
    args["llm"]["placement_group_config"] = {"bundles": [{"GPU": 1, "CPU": 4}] * 8,
                                             "strategy": "STRICT_PACK"}
    parsed = parse_app_args(args)
    assert parsed.predicted_layout().layout.value == "fp8_ds_mla"


def test_cuda_node_requires_compute_capability() -> None:
    args = local_args()
    args["dsv4"]["node"] = {"platform": "cuda"}
    with pytest.raises(ConfigError, match="compute_capability"):
        parse_app_args(args)


def test_sm100_flashinfer_backend_is_plain_rows() -> None:
    args = local_args()
    args["dsv4"]["node"] = {"platform": "cuda", "compute_capability": "10.0",
                            "attention_backend": "FLASHINFER_MLA_SPARSE_DSV4"}
    args["llm"]["placement_group_config"] = {"bundles": [{"GPU": 1}]}
    with pytest.raises(ConfigError, match="stores plain_rows"):
        parse_app_args(args)
    args["dsv4"]["expected_layout"] = "plain_rows"
    assert parse_app_args(args).predicted_layout().layout.value == "plain_rows"


def test_serve_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="does not exist"):
        load_serve_config(missing)
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"applications": [
        {"name": "x", "import_path": "ray.serve.llm:build_openai_app", "args": {}}]}))
    with pytest.raises(ConfigError, match="no application has import_path"):
        load_serve_config(other)
    dupes = tmp_path / "dupes.yaml"
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["applications"].append(copy.deepcopy(raw["applications"][0]))
    dupes.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"name \['dsv4'\] used more than once"):
        load_serve_config(dupes)
    bad = tmp_path / "bad.yaml"
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["applications"][0]["args"]["dsv4"]["controller_period_s"] = -1
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"applications\[dsv4\]\.args\.dsv4\.controller_period_s"):
        load_serve_config(bad)


def test_drain_settings_default_to_ours_and_keep_the_users() -> None:
    """Serve's 20 s/2 s defaults would cut long generations at shutdown; ours are explicit."""
    deploy = parse_app_args(local_args()).llm_config_dict("/m")["deployment_config"]
    assert deploy["graceful_shutdown_timeout_s"] == 60.0
    assert deploy["graceful_shutdown_wait_loop_s"] == 0.5
    args = set_path(local_args(), "llm.deployment_config.graceful_shutdown_timeout_s", 300)
    assert parse_app_args(args).llm_config_dict("/m")["deployment_config"][
        "graceful_shutdown_timeout_s"] == 300
    with pytest.raises(ConfigError, match="graceful_shutdown_timeout_s"):
        parse_app_args(set_path(local_args(),
                                "llm.deployment_config.graceful_shutdown_timeout_s", -1))


def test_second_signal_while_draining_stops_the_wait() -> None:
    import signal

    from deployments.local.drain import StopSignal

    stop = StopSignal(serving=True)
    stop._handler(signal.SIGTERM, None)  # first: ends the serving loop, no exception
    assert stop.event.is_set()
    stop.draining = True
    with pytest.raises(KeyboardInterrupt):
        stop._handler(signal.SIGINT, None)


def test_http_settings_reach_the_engine_and_contradictions_are_refused() -> None:
    """An absent token limit is bounded by the engine's default (http.max_tokens); the
    Responses store follows http.responses_store; a config that says otherwise is refused."""
    from deployments.config import checks
    from deployments.config.app_args import apply_http_to_engine

    base: dict[str, Any]
    base = {"llm": {"model_loading_config": {"model_id": "m", "model_source": "dsv4-tiny"},
                    "deployment_config": {"autoscaling_config": {"min_replicas": 1,
                                                                  "max_replicas": 2}}},
            "http": {"max_tokens": 512}}
    args = parse_app_args(base)
    data = args.llm_config_dict()
    lines = apply_http_to_engine(data, args.http)
    assert data["engine_kwargs"]["override_generation_config"] == {"max_new_tokens": 512}
    assert data["runtime_env"]["env_vars"]["VLLM_ENABLE_RESPONSES_API_STORE"] == "0"
    assert len(lines) == 2 and all("http." in line for line in lines)
    # a value the config sets is kept (and not logged as ours)
    kept = copy.deepcopy(base)
    kept["llm"]["engine_kwargs"] = {"override_generation_config": {"max_new_tokens": 100}}
    data = parse_app_args(kept).llm_config_dict()
    assert len(apply_http_to_engine(data, args.http)) == 1
    assert data["engine_kwargs"]["override_generation_config"]["max_new_tokens"] == 100

    def codes(raw: dict) -> set[str]:
        return {p.code for p in checks.check(parse_app_args(raw, refuse=False))}

    above = copy.deepcopy(base)
    above["llm"]["engine_kwargs"] = {"override_generation_config": {"max_new_tokens": 4096}}
    assert "default-tokens-above-bound" in codes(above)
    env = copy.deepcopy(base)
    env["llm"]["runtime_env"] = {"env_vars": {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}}
    assert "responses-store-conflict" in codes(env)
    on = copy.deepcopy(base)
    on["http"]["responses_store"] = True  # a fleet too: follow-ups are relayed
    assert codes(on) & {"responses-store-conflict"} == set()


def test_a_second_signal_as_the_drain_begins_still_shuts_down_cleanly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two SIGTERMs back to back (``timeout`` forwarding one, systemd sending another):
    the second lands as the drain starts. ``run`` stops waiting and shuts Serve and Ray
    down; the interrupt must not escape (Ray's excepthook would then block 60 s on a
    GCS that the shutdown just stopped, keeping the replicas alive)."""
    import ray

    from deployments.local import drain

    def second_signal(_timeout_s: float) -> bool:
        raise KeyboardInterrupt

    stopped: list[str] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(drain, "gcs_reachable", lambda: True)
    monkeypatch.setattr(drain, "drain_deadline_s", lambda _config: 1.0)
    monkeypatch.setattr(drain, "drain_while_cluster_lives", second_signal)
    monkeypatch.setattr(drain, "shutdown", lambda: stopped.append("serve and ray"))
    stop = drain.StopSignal(serving=True)
    drain.stop_everything(stop, load_serve_config(DEFAULT_CONFIG))
    assert stopped == ["serve and ray"] and stop.draining is False


def test_with_the_gcs_gone_run_stops_its_own_daemons_without_ray_shutdown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A process-group SIGTERM took the GCS down first: ``ray.shutdown()`` would
    disconnect from a dead GCS (in CI it retried, then died of SIGSEGV: ``run`` exited
    -11). ``stop_everything`` stops this process's children itself (a real child here)
    and marks Ray abandoned, so ``run`` ends through ``exit_now``, not Ray's atexit."""
    import subprocess
    import sys

    import psutil
    import ray

    from deployments.local import drain

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    called: list[str] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: called.append("ray.shutdown"))
    monkeypatch.setattr(drain, "gcs_reachable", lambda: False)
    monkeypatch.setattr(drain, "shutdown", lambda: called.append("serve and ray"))
    stop = drain.StopSignal(serving=True)
    try:
        drain.stop_everything(stop, load_serve_config(DEFAULT_CONFIG))
        child.wait(timeout=10)  # ended (stop_children reaped it, so no status is left)
        assert not psutil.pid_exists(child.pid)
    finally:
        if child.poll() is None:
            child.kill()
    assert called == [] and stop.ray_abandoned


def test_stop_children_kills_what_ignores_sigterm() -> None:
    import subprocess
    import sys
    import time

    from deployments.local.drain import stop_children

    stubborn = subprocess.Popen([sys.executable, "-c",
                                 "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('up', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline() == "up\n"
        started = time.monotonic()
        assert stop_children(grace_s=0.5) == [stubborn.pid]
        assert stubborn.wait(timeout=10) == -9 and time.monotonic() - started < 5
    finally:
        if stubborn.poll() is None:
            stubborn.kill()
