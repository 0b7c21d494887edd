"""The controller's Prometheus gauges, scraped from Ray's metrics endpoint of the session stack.

``ray.serve.metrics`` series are exported by Ray's per-node metrics agent
(``ray_head.start_cluster`` gives it a known port; ``ray_head.metrics_url``), prefixed
``ray_``, about one report interval (~10 s) after the controller sets them. The
session stack runs 2 agreeing replicas, so the gauges must say agree=1, running=2,
answered=2, odd=0 for the ``dsv4`` application, and checks with state ``agree``
must have been counted.
"""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.serve_client import wait_agree
from tests.support.stack import Stack

pytestmark = pytest.mark.slow

APP = "dsv4"
SCRAPE_TIMEOUT_S = 90.0
EXPECTED = {"ray_dsv4_kv_spec_agree": 1.0, "ray_dsv4_kv_spec_running_replicas": 2.0,
            "ray_dsv4_kv_spec_answered_replicas": 2.0, "ray_dsv4_kv_spec_odd_replicas": 0.0}
CHECKS = "ray_dsv4_kv_spec_checks_total"


def controller_replica_id() -> str:
    """The unique id of the running KV-spec controller replica of the app."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#KVSpecController#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(prefix)]
    assert len(names) == 1, f"expected one controller replica, found {names}"
    return names[0][len(prefix):]


def scrape(url: str, replica: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """dsv4 samples of the app's current controller replica: name -> [(labels, value)].

    A controller killed by an earlier test leaves its last series behind until Ray
    expires them; the ``replica`` label tells the current one apart.
    """
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (sample.name.startswith("ray_dsv4_kv_spec") and labels.get("application") == APP
                    and labels.get("replica", "").endswith(replica)):
                samples.setdefault(sample.name, []).append((labels, sample.value))
    return samples


def test_kv_spec_gauges_are_exported_with_the_verdict(serve_stack: Stack) -> None:
    from deployments.local import ray_head

    report = wait_agree(serve_stack.url, 2)
    url = ray_head.metrics_url()
    replica = controller_replica_id()
    started = time.monotonic()
    deadline = started + SCRAPE_TIMEOUT_S
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    while time.monotonic() < deadline:
        samples = scrape(url, replica)
        values = {name: [v for _, v in samples.get(name, [])] for name in EXPECTED}
        if all(values[name] == [want] for name, want in EXPECTED.items()) and any(
                n.startswith(CHECKS) for n in samples):
            break
        time.sleep(2)
    print(f"{url} after {time.monotonic() - started:.1f} s: "
          + "; ".join(f"{n}={[v for _, v in s]}" for n, s in sorted(samples.items())))
    if not samples:  # show what is there, e.g. if Serve's tag names change
        with urllib.request.urlopen(url, timeout=10) as resp:
            print([line for line in resp.read().decode().splitlines() if "dsv4_kv" in line])
    for name, want in EXPECTED.items():
        assert [v for _, v in samples.get(name, [])] == [want], (name, samples.get(name))
    [(labels, _)] = samples["ray_dsv4_kv_spec_agree"]
    assert labels["llm_deployment"] == report["deployment"], labels
    checks = {labels["state"]: value for name, series in samples.items()
              if name.startswith(CHECKS) and not name.endswith("_created")
              for labels, value in series}
    assert checks.get("agree", 0) >= 1, checks
