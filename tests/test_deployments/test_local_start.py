"""The local cluster's start, as `dsv4-serve run` does it: Ray notices its own raylet
promptly (``ray.prompt_node_registration``) and Serve's proxies are awaited after the
deploy starts, not before (``serve.controller_before_proxies``), in a fresh process."""

from __future__ import annotations

import textwrap

import pytest

from deployments import ray_touches
from tests.support.fresh_process import run_script


def test_both_touches_are_present_in_the_pinned_ray() -> None:
    assert ray_touches.present("ray.prompt_node_registration")
    assert ray_touches.present("serve.controller_before_proxies")


START = textwrap.dedent("""
    import json, os, stat, tempfile, urllib.error, urllib.request
    from pathlib import Path
    import ray
    from ray import serve
    from ray._private import services
    from deployments.config import DEFAULT_CONFIG, load_serve_config
    from deployments.local import ray_head
    from deployments.local import ray_token
    config = load_serve_config(DEFAULT_CONFIG)
    real_get_node = services.get_node
    home = Path(tempfile.mkdtemp())  # Ray's default token path (~/.ray/auth_token) lands here
    os.environ["HOME"] = str(home)
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        os.environ.pop(name, None)
    readable = home / "readable.token"
    readable.write_text("t")
    readable.chmod(0o644)
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(readable)
    try:  # refused before Ray starts, naming the file
        ray_head.start_cluster(config, wait_for_proxies=False)
        refused = ""
    except ray_token.TokenFileError as exc:
        refused = str(exc)
    os.environ.pop("RAY_AUTH_TOKEN_PATH")
    started = ray_head.start_cluster(config, num_cpus=ray_head.logical_cpus_needed(config),
                                     wait_for_proxies=False)
    try:
        token = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
        modes = {str(p): stat.S_IMODE(p.stat().st_mode)
                 for p in (token, home / ".ray" / "auth_token") if p.exists()}
        result = {"get_node_restored": services.get_node is real_get_node,
                  "refused": refused, "readable": str(readable), "token": str(token),
                  "modes": modes, "token_mode": ray._raylet.get_authentication_mode()
                  == ray._raylet.AuthenticationMode.TOKEN,
                  "cpus": started.cpus, "apps": sorted(serve.status().applications)}
        started.proxies_ready()
        url = f"http://127.0.0.1:{config.http_options.port}/-/routes"
        try:  # the proxy answers; with no application yet its route table is empty
            with urllib.request.urlopen(url, timeout=10) as resp:
                result["routes_status"] = resp.status
        except urllib.error.HTTPError as exc:
            result["routes_status"] = exc.code
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        ray_head.shutdown()
""")


@pytest.mark.slow
def test_the_local_start_defers_the_proxies_and_polls_the_raylet() -> None:
    result, logs = run_script(START)
    assert result["get_node_restored"], result
    # Ray's token is this user's alone: a 0644 one is refused naming it, no token
    # another user can read is written (Ray's own default would be 0644), token mode is on
    assert result["readable"] in result["refused"] and "chmod 600" in result["refused"], result
    assert result["modes"] == {result["token"]: 0o600}, result
    assert result["token_mode"], result
    assert result["apps"] == [], result  # the client Serve's API uses was registered
    # Serve's proxy answers (503: no route table before the first app), awaited after
    # the start returned
    assert result["routes_status"] in (200, 503), result
    assert "raylet was in the GCS" in logs, logs[-3000:]
    assert "proxies are awaited after the deploy starts" in logs, logs[-3000:]
