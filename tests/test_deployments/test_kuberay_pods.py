"""The pods the harness runs are the ones KubeRay 1.7 builds from the rendered CPU manifest
(ray-operator/controllers/ray/common/pod.go): fast, no podman."""

from __future__ import annotations

import pytest

from deployments.harness.kuberay_pods import cluster_plans, quantity, start_flags, worker_plan
from deployments.harness.kuberay_scenario import rayservice
from deployments.harness.records import REPO

SERVICE = rayservice(REPO / "k8s" / "local-cpu.rayservice.yaml")
SECRETS = {"dsv4-api-keys": {"api-keys": "k\n"}}
FQDN = "dsv4-local-cpu-raycluster-head-svc.default.svc.cluster.local"


def test_ray_start_is_kuberays():
    head, workers = cluster_plans(SERVICE, token="t", secrets=SECRETS)
    assert head.ray.env["KUBERAY_GEN_RAY_START_CMD"] == (
        "ray start --head --block --dashboard-agent-listen-port=52365 "
        "--dashboard-host=0.0.0.0 --memory=4294967296 --metrics-export-port=8080 "
        "--num-cpus=0 --num-gpus=0")
    assert len(workers) == 2  # replicas 2 x numOfHosts 1
    assert workers[0].ray.env["KUBERAY_GEN_RAY_START_CMD"] == (
        f"ray start --address={FQDN}:6379 --block --dashboard-agent-listen-port=52365 "
        "--memory=7516192768 --metrics-export-port=8080 --num-cpus=2")
    assert workers[0].ray.command[-1].startswith(
        "ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start --address=")
    assert head.aliases[0] == FQDN and workers[0].init is not None
    assert f"ray health-check --address {FQDN}:6379" in workers[0].init.command[-1]


def test_env_security_and_mounts_follow_the_manifest():
    head, [worker, _] = cluster_plans(SERVICE, token="tok", secrets=SECRETS)
    env = worker.ray.env
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == "tok"
    assert env["RAY_ADDRESS"] == f"{FQDN}:6379" and head.ray.env["RAY_ADDRESS"] == "127.0.0.1:6379"
    assert env["DSV4_API_KEYS_FILE"] == "/etc/dsv4-serve/api-keys/api-keys"
    assert "HF_TOKEN" not in env  # optional Secret, absent
    assert (worker.user, worker.read_only) == ("1000:100", True)
    assert worker.secrets == {"/etc/dsv4-serve/api-keys": "dsv4-api-keys"}
    assert "/tmp" in worker.tmpfs and worker.shm_bytes == 2 * 2**30
    assert head.shm_bytes == 4 * 2**30  # KubeRay's own /dev/shm: the memory limit
    assert (worker.ray.cpus, worker.ray.memory) == (2.0, 7 * 2**30)
    # A RayService worker's readiness asks its Serve proxy too, failure threshold 1.
    assert worker.ray.readiness is not None and worker.ray.readiness.failure_threshold == 1
    assert "http://localhost:8000/-/healthz" in worker.ray.readiness.command[-1]
    assert head.ray.readiness is not None
    assert head.ray.readiness.command[-1] == "http://localhost:52365/api/healthz"


def test_replacement_is_a_new_pod_of_the_same_spec():
    first = worker_plan(SERVICE, "cpu-local-cpu", 0, token="t", secrets=SECRETS)
    again = worker_plan(SERVICE, "cpu-local-cpu", "x1y2z", token="t", secrets=SECRETS)
    assert first.name != again.name and first.ray.image == again.ray.image
    assert first.ray.env["KUBERAY_GEN_RAY_START_CMD"] == again.ray.env[
        "KUBERAY_GEN_RAY_START_CMD"]


def test_flags_and_quantities():
    assert start_flags({"b": "true", "a": "1", "c": "false", "log-color": "false"}) == \
        "--a=1 --b --log-color=false"
    assert quantity("7Gi") == 7 * 2**30 and quantity("500m") == 0.5
    with pytest.raises(ValueError, match="expected a number"):
        quantity("7 GB")
