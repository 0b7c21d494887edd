"""Ray Serve's environment flags: the throughput-mode opt-in and who can reach a replica."""

from __future__ import annotations

import pytest

from deployments import serve_env
from deployments.config import DEFAULT_CONFIG, load_serve_config
from deployments.http import auth


def test_apply_sets_what_is_missing_and_keeps_what_the_user_set() -> None:
    env = {"RAY_SERVE_LOG_TO_STDERR": "0"}
    lines = serve_env.apply(env)
    assert env == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
                   "RAY_SERVE_LOG_TO_STDERR": "0"}
    assert any("RAY_SERVE_LOG_TO_STDERR=0 kept from the environment" in line for line in lines)
    assert any("RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (throughput mode)" in line for line in lines)
    assert serve_env.apply(env) == ["dsv4: Ray Serve env RAY_SERVE_LOG_TO_STDERR=0 kept from the "
                                    "environment (the throughput mode's is 1)"]


@pytest.mark.parametrize("env, listens", [
    ({}, False),
    (dict(serve_env.SERVE_ENV), False),
    ({"RAY_SERVE_ENABLE_HA_PROXY": "1"}, True),
    ({"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}, True),
    # Ray's throughput mode turns direct ingress on unless it is set: ours sets it to 0.
    ({"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}, True),
])
def test_listen_requested_follows_rays_resolution(env: dict[str, str], listens: bool) -> None:
    assert serve_env.listen_requested(env) is listens


def test_direct_ingress_needs_a_key_even_on_loopback() -> None:
    """Under direct ingress each replica listens itself: 127.0.0.1 in http_options no
    longer bounds who can connect, so the loopback exemption does not apply."""
    config = load_serve_config(DEFAULT_CONFIG)
    assert auth.is_loopback(config.http_options.host)
    auth.preflight(config, environ=dict(serve_env.SERVE_ENV))  # make run: no key needed
    with pytest.raises(auth.AuthConfigError, match="Serve direct ingress is on"):
        auth.preflight(config, environ={"RAY_SERVE_ENABLE_HA_PROXY": "1"})
    auth.preflight(config, environ={"RAY_SERVE_ENABLE_HA_PROXY": "1", "DSV4_API_KEYS": "k" * 32})



def test_local_quiet_env_sets_what_is_missing_and_names_what_the_user_set() -> None:
    env = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"}
    lines = serve_env.apply_local_quiet(env)
    assert env == {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1",
                   "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}
    assert lines == [
        "dsv4: Ray Serve env RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.1 kept from the environment "
        "(a local run's default is 0.5)",
        "dsv4: Ray Serve env RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000 (local run, quiet at rest)"]


def test_direct_env_pins_one_port() -> None:
    """Serve hands out range(MIN, MAX): MIN=p, MAX=p+1 leaves exactly p."""
    env = serve_env.direct_env(8018)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    lo, hi = (int(env[f"RAY_SERVE_DIRECT_INGRESS_{k}_HTTP_PORT"]) for k in ("MIN", "MAX"))
    assert list(range(lo, hi)) == [8018]
    assert serve_env.listen_requested(env)


@pytest.mark.parametrize("log_to_driver", [False, True])
def test_the_local_head_starts_without_the_monitors_it_cannot_use(log_to_driver: bool) -> None:
    from ray._private import parameter

    from deployments.local.ray_head import quiet_head

    real = parameter.RayParams
    with quiet_head(log_to_driver):
        params = parameter.RayParams(num_cpus=1)  # what ray.init builds, by this name
        assert isinstance(params, real)
        assert params.no_monitor is True
        # The log monitor only forwards worker logs to the driver: kept when asked for.
        assert params.include_log_monitor is (None if log_to_driver else False)
    assert parameter.RayParams is real
    assert real(num_cpus=1).no_monitor is False


@pytest.mark.parametrize("usage_stats", ["0", "1"])
def test_the_local_head_starts_no_dashboard_head_while_usage_stats_are_off(
        usage_stats: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The minimal dashboard head's one module reports usage stats: with them off (what
    ray.init sets) it is not started; with them on, or a dashboard asked for, it is."""
    from ray._private import node

    from deployments.local.ray_head import quiet_head

    calls: list[bool | None] = []

    def recorder(self: object, *, include_dashboard: bool | None,
                 raise_on_failure: bool) -> None:
        calls.append(include_dashboard)

    monkeypatch.setattr(node.Node, "start_api_server", recorder)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", usage_stats)
    with quiet_head(log_to_driver=False):
        node.Node.start_api_server(object(), include_dashboard=False, raise_on_failure=False)
        node.Node.start_api_server(object(), include_dashboard=True, raise_on_failure=True)
    assert node.Node.start_api_server is recorder  # restored
    assert calls == ([False, True] if usage_stats == "1" else [True])


def test_haproxy_ports_beside_a_door_are_distinct_and_each_a_flag_ray_reads() -> None:
    """Several HAProxy clusters on one machine (tests, benchmarks) must not collide, and
    every flag must be one Ray 2.60 reads (a renamed flag would leave Ray's default)."""
    import inspect

    from ray.serve._private import constants

    env = serve_env.haproxy_ports_beside(8040, replicas=3)
    direct = range(int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]),
                   int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]))
    side = [int(env[name]) for name in serve_env.HAPROXY_SIDE_PORTS]
    assert len(direct) == 3
    assert len({8040, *side, *direct}) == 1 + len(side) + len(direct)
    source = inspect.getsource(constants)
    assert [name for name in env if f'"{name}"' not in source] == []
