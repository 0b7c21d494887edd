"""The P/D output canary end to end: one pair of engines, clean canaries and four faults.

One P/D app (``configs/local-cpu-pd.yaml``, NIXL over DRAM) with the suite's scaled
dummy weights in both pools (same seed, so the canary's outputs depend on the context)
and the engine-site fault hooks (tests/support/pd_faults.py), switched by a file at run
time: one boot serves every case. The canaries run on the decode replica (its
``run_canary``, by handle) and by the controller's own loop, which must exclude the pair
within one period, route user requests to local prefill, and let the pair rejoin after
a clean canary.

``make test-pd`` only (``DSV4_FULL_PD=1``): a pair of engines beyond the session stack
does not fit ``make test``'s 60-minute budget. ``DSV4_PD_CANARY_CLEAN`` sets how many
clean canaries run (default 40); ``DSV4_PD_CANARY_OUT`` writes the measurements as JSON.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.pd_stack import REPO, deploy, pd_args
from tests.support.stack import Stack

FULL = os.environ.get("DSV4_FULL_PD") == "1"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not FULL, reason="make test-pd (DSV4_FULL_PD=1): a pair of "
                                 "engines beyond the session stack")]

APP = "pdcanary"
CLEAN = int(os.environ.get("DSV4_PD_CANARY_CLEAN", "40"))
FAULTS = ("drop_region", "truncate_region", "fail_receive", "stale_params")
PERIOD_S = 5.0
RESULTS: dict[str, Any] = {"clean": [], "faults": {}}


@pytest.fixture(scope="module")
def canary_app(serve_stack: Stack) -> Iterator[tuple[str, Path]]:
    from ray import serve

    from deployments.local import client

    fault_file = Path(tempfile.mkdtemp(prefix="dsv4-pd-faults-")) / "fault.json"
    fault_file.write_text("{}")
    args = pd_args()
    env = args["llm"]["runtime_env"]["env_vars"]
    site = [str(REPO / "tests" / "support" / "engine_site"), str(REPO)]
    env |= {"PYTHONPATH": os.pathsep.join([*site, os.environ.get("PYTHONPATH", "")]),
            "DSV4_TEST_SCALED_DUMMY_WEIGHTS": "1", "DSV4_TEST_PD_FAULTS": str(fault_file)}
    args["pd"]["canary"] = {"period_s": PERIOD_S}
    args["dsv4"]["controller_period_s"] = 5
    url = deploy(serve_stack, APP, args)
    try:
        client.wait_for_verdict(url, timeout_s=240)
        yield url, fault_file
    finally:
        serve.delete(APP)
        out = os.environ.get("DSV4_PD_CANARY_OUT")
        if out:
            Path(out).write_text(json.dumps(RESULTS, indent=1))


def report(url: str) -> dict[str, Any]:
    from deployments.local import client

    _, body = client.http_json(f"{url}/kv-spec")
    return body["pd"]


def wait_pd(url: str, pred: Any, timeout_s: float = 90.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    pd = report(url)
    while not pred(pd) and time.monotonic() < deadline:
        time.sleep(1)
        pd = report(url)
    assert pred(pd), pd
    return pd


def decode_handle(url: str) -> Any:
    from ray import serve

    name = report(url)["pools"]["decode"]["deployment"]
    return serve.get_deployment_handle(name, app_name=APP)


def canary(handle: Any, prefill: str, seed: int) -> dict[str, Any]:
    from deployments.control.canary_wire import CanaryRequest

    msg = CanaryRequest(prefill_replica=prefill, seed=seed, prompt_tokens=700, max_tokens=8)
    return handle.run_canary.remote(msg.model_dump(mode="json")).result(timeout_s=180)


def pair(url: str) -> tuple[str, str]:
    pd = wait_pd(url, lambda p: any(p["allowed"].values()), 180)
    [(decode, [prefill])] = pd["allowed"].items()
    return decode, prefill


def test_a_pair_joins_only_after_a_clean_canary_and_clean_canaries_pass(
        canary_app: tuple[str, Path]) -> None:
    url, _ = canary_app
    _, prefill = pair(url)
    pd = report(url)
    [first] = [c for c in pd["canaries"] if c["prefill_replica"] == prefill]
    assert first["passed"] and first["mode"] == "output", first
    handle = decode_handle(url)
    for seed in range(CLEAN):
        result = canary(handle, prefill, 10_000 + seed)
        RESULTS["clean"].append({k: result[k] for k in (
            "passed", "max_delta", "seconds", "external_tokens", "prompt_tokens", "reason")})
        assert result["passed"], result  # a false positive
        assert result["external_tokens"] >= result["prompt_tokens"] - 256, result
    deltas = [r["max_delta"] for r in RESULTS["clean"]]
    seconds = [r["seconds"] for r in RESULTS["clean"]]
    print(f"{CLEAN} clean canaries: max delta {max(deltas):.4f} nats, "
          f"{sum(seconds) / len(seconds):.2f} s each (max {max(seconds):.2f})")


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_is_caught_and_the_pair_excluded_until_clean(
        canary_app: tuple[str, Path], fault: str) -> None:
    from deployments.local import client

    url, fault_file = canary_app
    decode, prefill = pair(url)  # clean again after the previous case
    handle = decode_handle(url)
    canary(handle, prefill, 20_000)  # a clean predecessor for stale_params to replay
    fault_file.write_text(json.dumps({"fault": fault, "region": 0}))
    started = time.monotonic()
    try:
        caught = canary(handle, prefill, 20_001)
        assert not caught["passed"], caught
        pd = wait_pd(url, lambda p: not p["allowed"].get(decode) and any(
            not c["passed"] for c in p["canaries"]))
        detected_s = time.monotonic() - started
        bad = [c for c in pd["canaries"] if not c["passed"]]
        assert bad and bad[0]["reason"], pd
        assert pd["verdict"] in ("partial", "incompatible"), pd
        state = handle.pd_route_state.remote().result(timeout_s=30)
        assert state["allowed"] == [] and not state["may_transfer"], state
        status, body = client.http_json(f"{url}/completions", "POST", {
            "model": "dsv4-tiny", "prompt": "hello " * 300, "max_tokens": 4,
            "temperature": 0}, timeout=180)
        assert status == 200, body  # answered by local prefill, not through the pair
        RESULTS["faults"][fault] = {
            "caught_by_direct_canary": not caught["passed"], "reason": caught["reason"],
            "max_delta": caught["max_delta"], "finish_reason": caught["finish_reason"],
            "external_tokens": caught["external_tokens"],
            "controller_excluded_after_s": round(detected_s, 1),
            "controller_reason": bad[0]["reason"]}
    finally:
        fault_file.write_text("{}")
    wait_pd(url, lambda p: prefill in p["allowed"].get(decode, []), 120)
