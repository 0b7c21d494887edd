"""``http.ingress: haproxy``: the config rules, the env a cluster needs, the build-time
check that the cluster runs the door the config says, and the drain gate on
``/-/healthz``."""

from __future__ import annotations

import asyncio
import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments import serve_env
from deployments.config import (
    DEFAULT_CONFIG,
    ConfigError,
    PDAppArgs,
    load_serve_config,
    parse_app_args,
)
from deployments.config.checks import check
from deployments.doors.dataplane import DRAINED_MESSAGE, DataplaneGate

REPO = Path(__file__).resolve().parents[2]


def haproxy_args(**http: Any) -> dict[str, Any]:
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    args = copy.deepcopy(raw["applications"][0]["args"])
    args["http"].pop("replica_port", None)
    args["http"].update({"ingress": "haproxy", **http})
    return dict(args)


def test_haproxy_is_a_valid_door() -> None:
    assert parse_app_args(haproxy_args()).http.ingress == "haproxy"
    assert parse_app_args(haproxy_args(ingress="serve_proxy")).http.ingress == "serve_proxy"


def test_an_unknown_door_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"http\.ingress"):
        parse_app_args(haproxy_args(ingress="nginx"))


def test_a_pd_app_may_use_haproxy_and_its_decode_pool_drops_its_router() -> None:
    """HAProxy picks the decode replica (Ray 2.60 refuses a custom router on the ingress
    there: drained decode replicas fail /-/healthz instead); the prefill pool, reached by
    the decode replica's handle, keeps the router that sends only to proven replicas."""
    from deployments.pd import route
    from deployments.pd.builder import pool_router
    from deployments.serving.router import ROUTER_CLASS

    raw = yaml.safe_load((REPO / "configs" / "local-cpu-pd.yaml").read_text())
    args = raw["applications"][0]["args"]
    for door, decode_router in (("haproxy", None), ("serve_proxy", ROUTER_CLASS)):
        args["http"]["ingress"] = door
        parsed = parse_app_args(copy.deepcopy(args))
        assert isinstance(parsed, PDAppArgs) and parsed.http.ingress == door
        prefill = pool_router("prefill", {}, parsed)["request_router_config"]
        assert prefill == route.router_config()
        decode = pool_router("decode", {}, parsed).get("request_router_config")
        assert (decode or {}).get("request_router_class") == decode_router


def test_haproxy_beside_the_replica_port_is_refused() -> None:
    problems = check(parse_app_args(haproxy_args(), refuse=False))
    assert not problems or all(p.code != "ingress-two-doors" for p in problems)
    args = parse_app_args(haproxy_args(replica_port=8100), refuse=False)
    [problem] = [p for p in check(args) if p.code == "ingress-two-doors"]
    assert problem.is_error and "http.replica_port=8100" in problem.message
    assert "Fix" in problem.message


def test_apps_of_one_config_must_agree_on_the_door(tmp_path: Path) -> None:
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    first = raw["applications"][0]
    first["args"] = haproxy_args()
    second = copy.deepcopy(first)
    second.update(name="other", route_prefix="/other")
    second["args"]["http"]["ingress"] = "serve_proxy"
    raw["applications"].append(second)
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"different http\.ingress"):
        load_serve_config(path)


def test_apply_ingress_sets_the_cluster_flags_and_keeps_a_users() -> None:
    env = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
    lines = serve_env.apply_ingress("haproxy", env)
    assert env[serve_env.HAPROXY_FLAG] == "1"
    assert env[serve_env.HAPROXY_BINARY_FLAG].endswith("/dsv4-haproxy")
    assert Path(env[serve_env.HAPROXY_BINARY_FLAG]).is_absolute()
    assert env[serve_env.DRAIN_FLAG] == "10.5"  # twice HAProxy's 5 s + 250 ms at Ray's defaults
    assert env["RAY_SERVE_HAPROXY_NBTHREAD"] == "1"
    assert env["RAY_SERVE_HAPROXY_BALANCE_ALGORITHM"] == "hdr(x-session-id)"
    assert len(lines) == 5
    assert any("RAY_SERVE_HAPROXY_NBTHREAD=1 (one HAProxy thread" in line for line in lines)
    assert any("RAY_SERVE_HAPROXY_BALANCE_ALGORITHM=hdr(x-session-id) (session affinity"
               in line for line in lines), lines
    assert sum("one HAProxy thread" in line for line in lines) == 1, lines
    assert any(f"{serve_env.DRAIN_FLAG}=10.5 (local run: twice the 5.25 s" in line
               for line in lines), lines
    untouched: dict[str, str] = {}
    assert serve_env.apply_ingress("serve_proxy", untouched) == []
    assert untouched == {}


@pytest.mark.parametrize("ingress, env, fragment", [
    ("serve_proxy", {}, None),
    ("haproxy", {"RAY_SERVE_ENABLE_HA_PROXY": "1",
                 "RAY_SERVE_HAPROXY_BINARY_PATH": "/venv/bin/dsv4-haproxy"}, None),
    ("haproxy", {}, "runs without RAY_SERVE_ENABLE_HA_PROXY=1"),
    ("serve_proxy", {"RAY_SERVE_ENABLE_HA_PROXY": "1"}, "without the KV-spec drain"),
    ("haproxy", {"RAY_SERVE_ENABLE_HA_PROXY": "1"}, "every interface"),
    ("haproxy", {"RAY_SERVE_ENABLE_HA_PROXY": "1",
                 "RAY_SERVE_HAPROXY_BINARY_PATH": "/usr/sbin/haproxy"}, "every interface"),
])
def test_the_build_refuses_a_cluster_running_another_door(
        ingress: str, env: dict[str, str], fragment: str | None) -> None:
    problem = serve_env.ingress_problem(ingress, env)
    if fragment is None:
        assert problem is None
    else:
        assert problem is not None and fragment in problem and "Fix" in problem


def test_haproxy_side_ports_follow_the_environment() -> None:
    ports = dict(serve_env.haproxy_side_ports({"RAY_SERVE_HAPROXY_STATS_PORT": "9404"}))
    assert ports == {"RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 8500,
                     "RAY_SERVE_HAPROXY_STATS_PORT": 9404,
                     "RAY_SERVE_HAPROXY_METRICS_PORT": 9101}


def test_the_gate_fails_healthz_only_while_drained_and_keeps_serves_own_answer() -> None:
    answers = [(True, "success"), (True, "success"), (False, "DRAINING"), (True, "success")]

    async def serve_check() -> tuple[bool, str]:
        return answers.pop(0)

    gate = DataplaneGate()
    check_ = gate.wrap(serve_check)
    assert asyncio.run(check_()) == (True, "success")
    gate.follow(True)
    assert asyncio.run(check_()) == (False, DRAINED_MESSAGE)
    assert asyncio.run(check_()) == (False, "DRAINING")  # Serve's shutdown wins
    gate.follow(False)
    assert asyncio.run(check_()) == (True, "success")


def _pod_envs(manifest: dict[str, Any]) -> list[dict[str, str]]:
    cluster = manifest["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["workerGroupSpecs"]]
    return [{e["name"]: e.get("value") for e in c.get("env", [])}
            for t in templates for c in t["spec"]["containers"]]


def test_kuberay_presets_run_haproxy_on_every_pod_and_the_lint_holds_them_to_it() -> None:
    from deployments.k8s.lint import semantic_problems
    from deployments.k8s.params import DEFAULT_PARAMS, IMAGE_BIN_DIR, load_params, presets
    from deployments.k8s.render import render_manifest

    params = load_params()
    doors = {}
    for preset in presets(params, DEFAULT_PARAMS):
        manifest = render_manifest(preset, params)
        serve = yaml.safe_load(manifest["spec"]["serveConfigV2"])
        door = serve["applications"][0]["args"]["http"].get("ingress", "serve_proxy")
        doors[preset.name] = door
        for env in _pod_envs(manifest):
            assert (env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1") is (door == "haproxy")
            if door == "haproxy":
                assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == f"{IMAGE_BIN_DIR}/dsv4-haproxy"
        if door == "haproxy":  # one pod without the flag: the lint names it
            head = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
            head["spec"]["containers"][0]["env"] = [
                e for e in head["spec"]["containers"][0]["env"]
                if e["name"] != "RAY_SERVE_ENABLE_HA_PROXY"]
            assert any(p.startswith("head: env RAY_SERVE_ENABLE_HA_PROXY=None")
                       for p in semantic_problems(manifest)), preset.name
    # Every autoscaled multi-node GPU preset uses HAProxy, P/D included; the CPU preset
    # (stack cpu: the KubeRay harness's tiny model, `make test-kuberay`) uses Serve's proxy.
    cpu = {p.name for p in presets(params, DEFAULT_PARAMS) if p.stack == "cpu"}
    assert cpu == {"local-cpu"}, cpu
    assert doors.pop("local-cpu") == "serve_proxy"
    assert set(doors.values()) == {"haproxy"}, doors
    dockerfile = (Path(__file__).parents[2] / "Dockerfile").read_text()
    assert f"= {IMAGE_BIN_DIR}/dsv4-haproxy" in dockerfile


@pytest.mark.parametrize("value, seconds", [
    ("5s", 5.0), ("250ms", 0.25), ("250", 0.25), ("1m", 60.0), ("1500us", 0.0015)])
def test_haproxy_times_read_as_haproxy_reads_them(value: str, seconds: float) -> None:
    assert serve_env.haproxy_time_s(value) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "5 sec", "fast", "s"])
def test_a_bad_haproxy_time_is_named(bad: str) -> None:
    with pytest.raises(ValueError, match="HAProxy time"):
        serve_env.haproxy_time_s(bad)


def test_a_users_haproxy_thread_count_wins_and_is_named() -> None:
    env = {"RAY_SERVE_HAPROXY_NBTHREAD": "4"}
    lines = serve_env.apply_ingress("haproxy", env)
    assert env["RAY_SERVE_HAPROXY_NBTHREAD"] == "4"
    assert any("RAY_SERVE_HAPROXY_NBTHREAD=4 kept from the environment (dsv4-serve's "
               "default is 1)" in line for line in lines), lines


def test_ray_renders_the_thread_count_it_is_given(tmp_path: Path) -> None:
    """``HAPROXY_TUNING`` is a flag the installed Ray reads (default 4) and renders into
    the config it hands HAProxy: run in a fresh process, as each Ray process reads it."""
    import inspect
    import subprocess
    import sys

    from ray.serve._private import constants

    flag = "RAY_SERVE_HAPROXY_NBTHREAD"
    ours = serve_env.HAPROXY_TUNING[flag]
    assert f'os.environ.get("{flag}", "4")' in inspect.getsource(constants), \
        f"Ray's {flag} or its default changed"
    script = ("import sys, pathlib\n"
              "from deployments.harness.haproxy_config import ray_rendered_config\n"
              "print(ray_rendered_config(pathlib.Path(sys.argv[1])))\n")
    env = {k: v for k, v in os.environ.items() if k != flag}
    rendered = {value: subprocess.run([sys.executable, "-c", script, str(tmp_path)],
                                      env=env | ({flag: value} if value else {}),
                                      capture_output=True, text=True, check=True).stdout
                for value in ("", ours)}
    assert "\n    nbthread 4\n" in rendered[""]
    assert f"\n    nbthread {ours}\n" in rendered[ours]


def test_the_local_drain_window_follows_the_check_settings_and_keeps_a_users() -> None:
    """Twice the time HAProxy takes to mark a failing replica down, from the checks this
    cluster's HAProxy runs: a user's check settings move it, a user's window wins."""
    assert serve_env.local_drain_env({}) == {serve_env.DRAIN_FLAG: "10.5"}
    slow = {"RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER": "10s",
            "RAY_SERVE_HAPROXY_HEALTH_CHECK_FASTINTER": "1s",
            "RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL": "3"}
    assert serve_env.haproxy_down_s(slow) == 12.0
    assert serve_env.local_drain_env(slow) == {serve_env.DRAIN_FLAG: "24"}
    env = {serve_env.DRAIN_FLAG: "30"}
    lines = serve_env.apply_ingress("haproxy", env)
    assert env[serve_env.DRAIN_FLAG] == "30"
    assert any(f"{serve_env.DRAIN_FLAG}=30 kept from the environment" in line for line in lines)


def test_a_bad_check_setting_is_named_with_its_fix() -> None:
    with pytest.raises(ValueError, match=r"RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL='two'.*Fix"):
        serve_env.haproxy_down_s({"RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL": "two"})
    with pytest.raises(ValueError, match="HAProxy time '5 sec'"):
        serve_env.haproxy_down_s({"RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER": "5 sec"})


def test_the_check_defaults_are_the_installed_rays() -> None:
    """``HAPROXY_CHECK_DEFAULTS`` mirrors Ray's constants, read by Ray itself in a fresh
    process without those variables set; and Ray's HAProxy config still uses them."""
    import inspect
    import json
    import os
    import subprocess
    import sys

    names = [*serve_env.HAPROXY_CHECK_DEFAULTS, serve_env.DRAIN_FLAG]
    env = {k: v for k, v in os.environ.items() if k not in names}
    out = subprocess.run(
        [sys.executable, "-c", "import json; from ray.serve._private import constants as c; "
         f"print(json.dumps({{n: str(getattr(c, n)) for n in {names!r}}}))"],
        env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    rays = json.loads(out.strip().splitlines()[-1])
    drain = rays.pop(serve_env.DRAIN_FLAG)
    assert rays == serve_env.HAPROXY_CHECK_DEFAULTS, "Ray changed its HAProxy check defaults"
    assert float(drain) > float(serve_env.local_drain_env({})[serve_env.DRAIN_FLAG]), (
        "Ray's own drain window is no longer longer than the local one: drop the local one")
    from ray.serve._private import haproxy

    source = inspect.getsource(haproxy)
    for name in serve_env.HAPROXY_CHECK_DEFAULTS:
        assert name in source, f"Ray's HAProxy config no longer reads {name}"
