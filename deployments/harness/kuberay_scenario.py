"""KubeRay's job from a rendered RayService, step by step, on podman (``make test-kuberay``).

The operator's part, as KubeRay 1.7 does it: the head pod, the worker pods (their
``wait-gcs-ready`` init first), readiness probes; ``serveConfigV2`` PUT to the head's
dashboard at ``/api/serve/applications/`` with ``x-ray-authorization: Bearer <token>``
(utils/dashboardclient), then ``GET ...?api_type=declarative`` polled until the app is
RUNNING; a worker pod whose ray container died is deleted and a new pod made from the
same spec (a RayCluster reconcile). Then what a user checks: a chat completion through
the Service port (loopback), refused without a key; ``/v1/kv-spec`` agreeing over the
worker pods; the plugin's log line in a worker container. Every wait is bounded.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from deployments.harness.kuberay_podman import Cluster, leftovers
from deployments.harness.kuberay_pods import cluster_plans, worker_plan
from deployments.harness.kv_poll import TRANSIENT, kv_report

APPS_PATH = "/api/serve/applications/"
# What the plugin logs in every engine process about auto (dsv4_patch/patches/kv_dtype.py:
# "... resolves to fp8_ds_mla", or on a release that already resolves auto like upstream
# 0.30+, "... skipped: ... (auto -> fp8_ds_mla)"), and what vLLM logs of the cache it made.
PLUGIN_LINE = r"dsv4_patch: .*auto.*fp8_ds_mla"
ENGINE_LINE = "Using DeepSeek's fp8_ds_mla KV cache format"
HEAD_READY_S, WORKER_READY_S, RUNNING_S, AGREE_S = 240.0, 420.0, 600.0, 300.0


@dataclass
class Run:
    """What a harness run measured (seconds) and saw."""

    times: dict[str, float] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)


def rayservice(path: Path) -> dict[str, Any]:
    """The RayService document of a rendered manifest file."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    [service] = [d for d in docs if d.get("kind") == "RayService"]
    return service


def submit(dashboard: str, service: Mapping[str, Any], token: str) -> None:
    """What the operator sends: serveConfigV2 as JSON, PUT, token in x-ray-authorization."""
    body = json.dumps(yaml.safe_load(service["spec"]["serveConfigV2"]))
    resp = httpx.put(f"{dashboard}{APPS_PATH}", content=body, timeout=60,
                     headers={"Content-Type": "application/json",
                              "x-ray-authorization": f"Bearer {token}"})
    if not 200 <= resp.status_code < 300:
        raise AssertionError(f"PUT {APPS_PATH}: {resp.status_code} {resp.text[:500]}")


def app_statuses(dashboard: str, token: str) -> dict[str, str]:
    resp = httpx.get(f"{dashboard}{APPS_PATH}", params={"api_type": "declarative"},
                     headers={"x-ray-authorization": f"Bearer {token}"}, timeout=30)
    resp.raise_for_status()
    apps = resp.json().get("applications") or {}
    return {name: app.get("status", "") for name, app in apps.items()}


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 2.0) -> Any:
    """Poll ``check`` until it returns a truthy value; the last value in the error."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (*TRANSIENT, OSError) as exc:
            last = repr(exc)
        time.sleep(every)
    raise AssertionError(f"{what}: not reached in {timeout:.0f} s; last: {str(last)[:2000]}")


def agreement(serve: str, key: str, count: int, besides: set[str] | None = None) -> Any:
    """A check: the report agrees over ``count`` replicas on ``count`` distinct nodes
    (and one node not in ``besides``, after a replacement)."""
    def check() -> dict[str, Any] | None:
        status, rep = kv_report(f"{serve}/v1", headers={"Authorization": f"Bearer {key}"},
                                timeout=60)
        nodes = {r.get("node_id") for r in rep.get("replicas", [])}
        ok = (status == 200 and rep.get("state") == "agree"
              and rep.get("answered") == rep.get("running_replicas") == count == len(nodes)
              and (besides is None or bool(nodes - besides)))
        return rep if ok else None
    return check


def chat(serve: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{serve}/v1/chat/completions", headers=headers, timeout=120, json={
        "model": "dsv4-tiny", "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hello"}]})


def boot(cluster: Cluster, service: Mapping[str, Any], token: str, run: Run
         ) -> tuple[str, str, list[str]]:
    """Head, workers, serveConfigV2; returns (dashboard URL, serve URL, worker pods)."""
    head, workers = cluster_plans(service, token=token, secrets=cluster.secrets)
    start = time.monotonic()
    cluster.create_network()
    cluster.create_pod(head, publish=("serve", "dashboard"))
    cluster.start_pod(head.name, timeout=120)
    run.times["head_ready_s"] = cluster.wait_ready(head.name, HEAD_READY_S)
    dashboard = f"http://127.0.0.1:{cluster.host_port(head.name, head.ports['dashboard'])}"
    serve = f"http://127.0.0.1:{cluster.host_port(head.name, head.ports['serve'])}"
    for pod in workers:
        cluster.create_pod(pod)
        cluster.start_pod(pod.name, timeout=180)
    submit(dashboard, service, token)
    run.times["config_submitted_s"] = time.monotonic() - start
    apps = [a["name"] for a in yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]]
    wait_for("serveConfigV2 applications RUNNING", lambda: (
        (s := app_statuses(dashboard, token)) and all(s.get(a) == "RUNNING" for a in apps)),
        RUNNING_S)
    run.times["apps_running_s"] = time.monotonic() - start
    for pod in workers:
        cluster.wait_ready(pod.name, WORKER_READY_S)
    run.times["workers_ready_s"] = time.monotonic() - start
    run.facts["rayStart"] = {p.name: p.ray.env["KUBERAY_GEN_RAY_START_CMD"]
                             for p in [head, *workers]}
    return dashboard, serve, [p.name for p in workers]


def replace_dead(cluster: Cluster, service: Mapping[str, Any], token: str,
                 pods: list[str]) -> list[str]:
    """The reconcile: a worker pod whose ray container exited is deleted and a new pod
    from its group's spec (a new generated name) takes its place."""
    alive = []
    for name in pods:
        if cluster.running(name):
            alive.append(name)
            continue
        group = cluster.pods[name].group
        cluster.remove_pod(name)
        plan = worker_plan(service, group, uuid.uuid4().hex[:5], token=token,
                           secrets=cluster.secrets)
        cluster.create_pod(plan)
        cluster.start_pod(plan.name, timeout=180)
        alive.append(plan.name)
    return alive


def grep_logs(cluster: Cluster, pod: str, pattern: str) -> str:
    """The first line matching ``pattern`` in the Ray logs inside the pod's container."""
    return cluster.exec(pod, "bash", "-c", f"grep -rhoE \"{pattern}.{{0,80}}\" "
                        "/tmp/ray/session_latest/logs/ | head -n 1").strip()  # noqa: S108  # Ray's log dir in the container


def scenario(manifest: Path, run: Run) -> None:
    """The whole story; ``run`` fills as it goes (kept on failure for the message)."""
    service = rayservice(manifest)
    token, key = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    cluster = Cluster(uuid.uuid4().hex[:8], {"dsv4-api-keys": {"api-keys": key + "\n"}})
    try:
        _, serve, workers = boot(cluster, service, token, run)
        ok, refused = chat(serve, key), chat(serve, None)
        run.facts["chat_status"], run.facts["no_key_status"] = ok.status_code, refused.status_code
        run.facts["chat_text"] = ok.text[:300]
        rep = wait_for("kv-spec agreement", agreement(serve, key, len(workers)), AGREE_S)
        before = {r["node_id"] for r in rep["replicas"]}
        run.facts["agree_before"] = {"state": rep["state"], "nodes": len(before)}
        run.facts["plugin_log"] = {w: grep_logs(cluster, w, PLUGIN_LINE) for w in workers}
        run.facts["engine_log"] = {w: grep_logs(cluster, w, ENGINE_LINE) for w in workers}
        victim, start = workers[0], time.monotonic()
        cluster.kill(victim)
        workers = wait_for("the killed worker replaced", lambda: (
            (now := replace_dead(cluster, service, token, workers)) != workers and now),
            60, every=1.0)
        run.times["replacement_pod_started_s"] = time.monotonic() - start
        rep = wait_for("kv-spec agreement after the replacement",
                       agreement(serve, key, len(workers), besides=before), AGREE_S)
        run.times["kill_to_agree_s"] = time.monotonic() - start
        run.facts["agree_after"] = {"state": rep["state"],
                                    "nodes": len({r["node_id"] for r in rep["replicas"]})}
        run.facts["chat_after_status"] = chat(serve, key).status_code
    finally:
        cleanup_start = time.monotonic()
        cluster.cleanup()
        run.times["cleanup_s"] = time.monotonic() - cleanup_start
        run.facts["leftovers"] = leftovers()
