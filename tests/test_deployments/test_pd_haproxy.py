"""P/D behind HAProxy, the door the KubeRay P/D preset ships: ``dsv4-serve run`` of
``configs/local-cpu-pd.yaml`` with ``http.ingress: haproxy``. HAProxy picks the decode
replica (the ingress), which hands the prompt to the prefill pool through its own
router; a request through HAProxy's port is prefilled by the prefill engine and decoded
from the KV it sent over NIXL, as through Serve's proxy (``test_pd_serving.py``), and a
request without the key is refused at the door. A pair of engines in a cluster of its
own: ``make test-pd`` only (``DSV4_FULL_PD=1``), out of ``make test``'s budget.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from deployments import serve_env
from deployments.harness.kv_poll import kv_report
from deployments.harness.run_process import SERVING_LINE, read_until_serving

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("DSV4_FULL_PD") != "1",
    reason="make test-pd (DSV4_FULL_PD=1): a pair of engines in a cluster of its own")]

REPO = Path(__file__).resolve().parents[2]
PORT = 8060
URL = f"http://127.0.0.1:{PORT}/v1"
KEY = "pd-haproxy-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = " ".join(["hello world"] * 350)  # ~700 tokens: several 256-token blocks
SOURCE = "prompt_tokens_by_source_total"
BOOT_TIMEOUT_S = 600.0
STEP_TIMEOUT_S = 120.0


def haproxy_pd_config(tmp: Path) -> Path:
    raw = yaml.safe_load((REPO / "configs" / "local-cpu-pd.yaml").read_text())
    raw["http_options"]["port"] = PORT
    raw["applications"][0]["args"]["http"]["ingress"] = "haproxy"
    path = tmp / "pd-haproxy.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The run's boot output, while it serves; SIGTERM (then SIGKILL) its group after."""
    config = haproxy_pd_config(tmp_path_factory.mktemp("pd-haproxy"))
    exe = Path(sys.executable).with_name("dsv4-serve")
    proc = subprocess.Popen(
        [str(exe), "run", str(config), "--no-smoke"], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1", "DSV4_API_KEYS": KEY}
        | serve_env.haproxy_ports_beside(PORT, replicas=4))
    try:
        out = read_until_serving(proc, BOOT_TIMEOUT_S)
        assert SERVING_LINE in out, out[-4000:]
        yield out
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise


def compatible_report() -> dict[str, Any]:
    """``/v1/kv-spec`` through HAProxy once the P/D check has allowed a pair."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while True:
        status, report = kv_report(URL, headers=AUTH)
        if status == 200 and (report.get("pd") or {}).get("verdict") == "compatible":
            return report
        assert time.monotonic() < deadline, (status, report)
        time.sleep(2)


def engine_samples(metrics: str, pools: dict[str, str]) -> dict[str, float]:
    """"pool:source" -> prompt tokens by source, summed over the pool's replicas."""
    with urllib.request.urlopen(metrics, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            pool = pools.get(s.labels.get("ReplicaId", ""))
            if s.name.endswith(SOURCE) and pool is not None:
                key = f"{pool}:{s.labels.get('source', '')}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def test_haproxy_is_the_door_and_demands_the_key(run: str) -> None:
    [door] = {c.pid for c in psutil.net_connections(kind="tcp")
              if c.status == psutil.CONN_LISTEN and c.laddr.port == PORT}
    assert "haproxy" in psutil.Process(door).name(), psutil.Process(door).cmdline()
    refused = httpx.post(f"{URL}/completions", timeout=30,
                         json={"model": "dsv4-tiny", "prompt": "x", "max_tokens": 1})
    assert refused.status_code == 401, refused.text


def test_a_request_through_haproxy_is_prefilled_remotely(run: str) -> None:
    assert "http.ingress: haproxy" in run, run[-3000:]
    [metrics] = re.findall(r"Prometheus metrics: (\S+)", run)
    report = compatible_report()
    pools = {rid: name for name, pool in report["pd"]["pools"].items()
             for rid in pool["replicas"]}
    before = engine_samples(metrics, pools)
    served = httpx.post(f"{URL}/completions", headers=AUTH, timeout=180, json={
        "model": "dsv4-tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert served.status_code == 200, served.text
    prompt = served.json()["usage"]["prompt_tokens"]
    deadline = time.monotonic() + STEP_TIMEOUT_S  # series land one report interval later
    while True:
        after = engine_samples(metrics, pools)
        delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
        if delta.get("decode:external_kv_transfer", 0.0) > 0 or time.monotonic() > deadline:
            break
        time.sleep(2)
    print(f"P/D through HAProxy: {prompt} prompt tokens; {delta}")
    assert delta.get("prefill:local_compute", 0.0) >= prompt - 1, delta
    assert delta.get("decode:external_kv_transfer", 0.0) >= prompt - 256, delta
    assert delta.get("decode:local_compute", 0.0) < 256, delta
