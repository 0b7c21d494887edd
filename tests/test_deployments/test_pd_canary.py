"""The P/D output canary end to end: one pair of engines, clean canaries and four faults.

One P/D app (``configs/local-cpu-pd.yaml``, NIXL over DRAM) with the suite's scaled
dummy weights in both pools (same seed, so the canary's outputs depend on the context)
and the engine-site fault hooks (tests/support/pd_faults.py), switched by a file at run
time: one boot serves every case. The canaries run on the decode replica (its
``run_canary``) from the controller's own loop, which must exclude the pair within one
period, route user requests to local prefill, and let the pair rejoin after a clean
canary. A failed receive must also raise the decode replica's count of failed KV
transfers (vLLM's NIXL counter, read in the replica), which fails its pairs by name.

``make test`` (CI) runs one case on this pair: vllm#57661's fault, a region truncated
after receive, which equal specs cannot see, caught by the output alone. ``make test-pd``
(``DSV4_FULL_PD=1``) adds the other three faults and two minutes of clean canaries
(``DSV4_PD_CANARY_CLEAN_S``, default 120 s). The canary's cost and false-positive count over
hundreds of canaries: ``python -m benchmarks.pd_canary``.
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

from deployments.harness import canary_runs
from deployments.pd import canary
from deployments.pd.route import CANARY_PREFIX
from tests.support.pd_stack import REPO, deploy, pd_args
from tests.support.stack import Stack

FULL = os.environ.get("DSV4_FULL_PD") == "1"
pytestmark = pytest.mark.slow
ONLY_FULL = pytest.mark.skipif(not FULL, reason="make test-pd (DSV4_FULL_PD=1): CI runs one "
                               "fault on this pair (truncate_region) within its budget")

APP = "pdcanary"
CLEAN_S = float(os.environ.get("DSV4_PD_CANARY_CLEAN_S", "120"))
CI_FAULT = "truncate_region"
FAULTS = [pytest.param(f, marks=() if f == CI_FAULT else ONLY_FULL)
          for f in canary_runs.FAULTS]
PERIOD_S = 5.0


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
    args["pd"]["canary"] = {"period_s": PERIOD_S, "prompt_tokens": 300}
    args["dsv4"]["controller_period_s"] = 5
    url = deploy(serve_stack, APP, args)
    try:
        client.wait_for_verdict(url, timeout_s=240)
        yield url, fault_file
    finally:
        serve.delete(APP)


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


def pair(url: str) -> tuple[str, str]:
    pd = wait_pd(url, lambda p: any(p["allowed"].values()), 240)
    [(decode, [prefill])] = pd["allowed"].items()
    clean = [c for c in pd["canaries"] if c["decode_replica"] == decode
             and c["prefill_replica"] == prefill]
    assert clean and clean[-1]["passed"], pd  # it joined on a clean canary of its own
    return decode, prefill


@ONLY_FULL
def test_a_pair_joins_only_after_a_clean_canary_and_clean_canaries_pass(
        canary_app: tuple[str, Path]) -> None:
    """The controller's own canaries, every period, for ``CLEAN_S`` seconds: none fails."""
    url, _ = canary_app
    _, prefill = pair(url)
    seen: dict[float, dict[str, Any]] = {}
    deadline = time.monotonic() + CLEAN_S
    while time.monotonic() < deadline:
        pd = report(url)
        for c in pd["canaries"]:
            seen.setdefault(c["at"], c)
        assert pd["canary_totals"].get("failed", 0) == 0, pd  # a false positive
        assert pd["canary_totals"].get("failed_by_counter", 0) == 0, pd  # a failed transfer
        time.sleep(2)
    first = min(seen.values(), key=lambda c: c["at"])
    assert first["passed"] and first["mode"] == "output" and \
        first["prefill_replica"] == prefill, first
    for c in seen.values():
        assert c["external_tokens"] >= c["prompt_tokens"] - 256, c  # arrived over NIXL
    deltas = [c["max_delta"] for c in seen.values()]
    seconds = [c["seconds"] for c in seen.values()]
    assert report(url)["failed_kv_transfers"], report(url)  # read from the decode replica
    print(f"{report(url)['canary_totals']} canaries, {len(seen)} seen: max delta "
          f"{max(deltas):.4f} nats, {sum(seconds) / len(seconds):.1f} s each")


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_is_caught_and_the_pair_excluded_until_clean(
        canary_app: tuple[str, Path], fault: str) -> None:
    from deployments.local import client

    url, fault_file = canary_app
    decode, prefill = pair(url)  # clean again after the previous case
    handle = decode_handle(url)
    log = Path(f"{fault_file}.log")
    logged = log.read_text() if log.exists() else ""
    counted = report(url)["failed_kv_transfers"].get(decode)
    assert isinstance(counted, int), report(url)  # the decode replica reads vLLM's counter
    fault_file.write_text(json.dumps({"fault": fault, "region": 0, "keep": "smallest"}))
    started = time.monotonic()
    try:
        pd = wait_pd(url, lambda p: not p["allowed"].get(decode) and any(
            not c["passed"] for c in p["canaries"]), 150)
        detected_s = time.monotonic() - started
        [bad] = [c for c in pd["canaries"] if not c["passed"]]
        assert bad["reason"] and pd["verdict"] in ("partial", "incompatible"), pd
        fired = [json.loads(line) for line in log.read_text()[len(logged):].splitlines()]
        assert any(f["fault"] == fault for f in fired), fired  # the fault really happened
        state = handle.pd_route_state.remote().result(timeout_s=30)
        assert state["allowed"] == [] and not state["may_transfer"], state
        status, body = client.http_json(f"{url}/completions", "POST", {
            "model": "dsv4-tiny", "prompt": canary.prompt(7, 300, 1024), "max_tokens": 2,
            "temperature": 0}, timeout=120)
        assert status == 200, body  # answered by local prefill, not through the pair
        after = [json.loads(line) for line in log.read_text()[len(logged):].splitlines()]
        users = [f for f in after[len(fired):] if "request" in f
                 and CANARY_PREFIX not in str(f["request"])]
        assert not users, users  # no user request's pages crossed the failed pair
        if fault == "fail_receive":  # vLLM counts it; the controller names the decode replica
            pd = wait_pd(url, lambda p: p["failed_kv_transfers"].get(decode, 0) > counted
                         and any(c["failed_kv_transfers"] for c in p["canaries"]), 60)
            [by_counter] = [c for c in pd["canaries"] if c["failed_kv_transfers"]]
            assert by_counter["decode_replica"] == decode and not by_counter["passed"], pd
            assert f"decode replica {decode} counted {by_counter['failed_kv_transfers']} " \
                "failed KV transfer(s)" in by_counter["reason"], by_counter
            assert not pd["allowed"].get(decode), pd
        now = report(url)["failed_kv_transfers"].get(decode)
        print(f"{fault}: caught ({bad['reason']}), pair excluded {detected_s:.1f} s after "
              f"the fault was set; hook: {[f for f in fired if f['fault'] == fault][:1]}; "
              f"decode's failed KV transfers {counted} -> {now}")
    finally:
        fault_file.write_text("{}")
    wait_pd(url, lambda p: prefill in p["allowed"].get(decode, []), 150)
