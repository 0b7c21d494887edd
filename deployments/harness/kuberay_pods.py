"""The pods the KubeRay operator would make from a rendered RayService, as plain plans.

Read from KubeRay 1.7's pod builder (ray-operator/controllers/ray/common/pod.go,
utils/constant.go): ``ulimit -n ...; ray start [--head] --block --k=v...`` with the
flags sorted and KubeRay's defaults added (``--block``, ``--dashboard-agent-listen-port``,
``--num-cpus``/``--memory`` from the container's limits, a worker's ``--address`` of the
head Service), the env it injects (``RAY_ADDRESS``, ``FQ_RAY_IP``, ``RAY_AUTH_*``,
``KUBERAY_GEN_RAY_START_CMD``, ...), a ``/dev/shm`` emptyDir when the spec has none, the
``wait-gcs-ready`` init container on workers, and the probes Ray >= 2.53 gets (HTTP
``/api/healthz`` on the dashboard agent; a RayService worker's readiness also asks its
Serve proxy). ``deployments.harness.kuberay_podman`` runs these plans.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

NAMESPACE = "default"
AGENT_PORT = 52365  # utils.DefaultDashboardAgentListenPort
GCS_PORT = "6379"
WGET = "wget --tries 1 -T {t} -q -O- http://localhost:{port}/{path} | grep success"
WAIT_GCS = """SECONDS=0
while true; do
  if ray health-check --address {addr} > /dev/null 2>&1; then echo "GCS is ready."; break; fi
  echo "$SECONDS seconds elapsed: Waiting for GCS to be ready."; sleep 5
done"""


@dataclass(frozen=True)
class Probe:
    """A kubelet probe: an exec command, or an HTTP GET run inside the pod."""

    command: tuple[str, ...]
    initial_delay_s: int
    period_s: int
    timeout_s: int
    failure_threshold: int


@dataclass
class ContainerPlan:
    """One container of a pod: what `podman create` needs."""

    name: str
    image: str
    command: list[str]
    env: dict[str, str]
    cpus: float | None = None
    memory: int | None = None
    readiness: Probe | None = None
    liveness: Probe | None = None


@dataclass
class PodPlan:
    """One pod: its containers (init first), ports, mounts and security settings."""

    name: str
    group: str
    ray: ContainerPlan
    init: ContainerPlan | None = None
    ports: dict[str, int] = field(default_factory=dict)
    shm_bytes: int = 0
    tmpfs: list[str] = field(default_factory=list)
    secrets: dict[str, str] = field(default_factory=dict)  # mount path -> Secret name
    volumes: dict[str, str] = field(default_factory=dict)  # mount path -> PVC claim name
    user: str = ""
    read_only: bool = False
    aliases: list[str] = field(default_factory=list)


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity ("7Gi", "500m", "2") in base units."""
    text = str(value)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3, "k": 1e3,
             "M": 1e6, "G": 1e9}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    if not match or (match.group(2) and match.group(2) not in units):
        raise ValueError(f"quantity {text!r}: expected a number with an optional unit "
                         f"({', '.join(units)})")
    return float(match.group(1)) * units.get(match.group(2), 1)


def start_flags(params: Mapping[str, str]) -> str:
    """KubeRay's convertParamMap: sorted keys; "true" -> ``--k``, "false" dropped."""
    flags = []
    for key in sorted(params):
        value = str(params[key])
        if value.lower() in ("true", "false") and key not in (
                "log-color", "include-dashboard", "include-log-monitor"):
            if value.lower() == "true":
                flags.append(f"--{key}")
        else:
            flags.append(f"--{key}={value}")
    return " ".join(flags)


def ray_start(head: bool, params: Mapping[str, str], limits: Mapping[str, Any],
              head_fqdn: str) -> str:
    """The ``ray start`` command KubeRay generates (setMissingRayStartParams +
    generateRayStartCommand)."""
    full = dict(params)
    if not head:
        full.setdefault("address", f"{head_fqdn}:{GCS_PORT}")
    else:
        full.setdefault("dashboard-host", "0.0.0.0")  # noqa: S104  # KubeRay's default, inside the pod
    full.setdefault("metrics-export-port", "8080")
    full["block"] = "true"
    full.setdefault("dashboard-agent-listen-port", str(AGENT_PORT))
    if "num-cpus" not in full and "cpu" in limits:
        full["num-cpus"] = str(int(-(-quantity(limits["cpu"]) // 1)))  # Quantity.Value(): ceil
    if "memory" not in full and "memory" in limits:
        full["memory"] = str(int(quantity(limits["memory"])))
    return f"ray start{' --head' if head else ''} {start_flags(full)}"


def _env(container: Mapping[str, Any], pod_name: str, group: str,
         secrets: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """The container's env with valueFrom resolved as the kubelet would."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        source = item["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = secrets.get(ref["name"], {}).get(ref["key"])
            if value is None and not ref.get("optional"):
                raise ValueError(f"env {item['name']}: Secret {ref['name']}/{ref['key']} is "
                                 "missing and not optional; expected the harness to have it. "
                                 "Fix: pass it in secrets.")
            if value is not None:
                env[item["name"]] = value
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            env[item["name"]] = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE
                                 }.get(path, group)
    return env


def _kuberay_env(env: dict[str, str], *, head: bool, cluster: str, head_fqdn: str,
                 pod_name: str, group: str, start_cmd: str, token: str) -> dict[str, str]:
    """What KubeRay adds (setContainerEnvVars, SetContainerTokenAuthEnvVars): only names
    the spec does not set."""
    added = {
        "FQ_RAY_IP": head_fqdn, "RAY_IP": head_fqdn.split(".")[0],
        "RAY_CLUSTER_NAME": cluster, "RAY_CLUSTER_NAMESPACE": NAMESPACE,
        "RAY_CLOUD_INSTANCE_ID": pod_name, "RAY_NODE_TYPE_NAME": group,
        "KUBERAY_GEN_RAY_START_CMD": start_cmd, "RAY_PORT": GCS_PORT,
        "RAY_TIMEOUT_MS_TASK_WAIT_FOR_DEATH_INFO": "0",
        "RAY_GCS_SERVER_REQUEST_TIMEOUT_SECONDS": "5", "RAY_SERVE_KV_TIMEOUT_S": "5",
        "RAY_ADDRESS": f"{'127.0.0.1' if head else head_fqdn}:{GCS_PORT}",
        "RAY_USAGE_STATS_KUBERAY_IN_USE": "1", "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE": "1",
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
    }
    if not head:
        added["RAY_gcs_rpc_server_reconnect_timeout_s"] = "600"
    return env | {k: v for k, v in added.items() if k not in env}


def _probes(head: bool, serve_port: int) -> tuple[Probe, Probe]:
    """(readiness, liveness) for Ray >= 2.53 (initLivenessAndReadinessProbe)."""
    http = ("wget", "--tries", "1", "-T", "5" if head else "2", "-q", "-O-",
            f"http://localhost:{AGENT_PORT}/api/healthz")
    timeout = 5 if head else 2
    liveness = Probe(http, 30, 5, timeout, 120)
    if head:
        return Probe(http, 10, 5, timeout, 10), liveness
    # A RayService worker: the raylet check and its Serve proxy's, failure threshold 1.
    check = " && ".join([WGET.format(t=2, port=AGENT_PORT, path="api/local_raylet_healthz"),
                         WGET.format(t=10, port=serve_port, path="-/healthz")])
    return Probe(("bash", "-c", check), 10, 5, timeout, 1), liveness


def pod_plan(group_spec: Mapping[str, Any], *, head: bool, cluster: str, pod_name: str,
             token: str, secrets: Mapping[str, Mapping[str, str]]) -> PodPlan:
    """One pod of a head group or worker group, as KubeRay's BuildPod makes it."""
    spec = group_spec["template"]["spec"]
    container = spec["containers"][0]
    group = "headgroup" if head else group_spec["groupName"]
    head_fqdn = f"{cluster}-head-svc.{NAMESPACE}.svc.cluster.local"
    limits = container.get("resources", {}).get("limits", {})
    start = ray_start(head, group_spec.get("rayStartParams", {}), limits, head_fqdn)
    env = _kuberay_env(_env(container, pod_name, group, secrets), head=head, cluster=cluster,
                       head_fqdn=head_fqdn, pod_name=pod_name, group=group, start_cmd=start,
                       token=token)
    ports = {p["name"]: int(p["containerPort"]) for p in container.get("ports", [])}
    readiness, liveness = _probes(head, ports.get("serve", 8000))
    command = ["/bin/bash", "-c", "--",
               f"ulimit -n ${{RAY_START_ULIMIT_OPEN_FILES:-65536}}; {start}"]
    ray = ContainerPlan(container["name"], container["image"], command, env,
                        cpus=quantity(limits["cpu"]) if "cpu" in limits else None,
                        memory=int(quantity(limits["memory"])) if "memory" in limits else None,
                        readiness=readiness, liveness=liveness)
    plan = PodPlan(pod_name, group, ray, ports=ports)
    _mounts(plan, spec, container)
    if not head:  # wait-gcs-ready: the ray container's image, env and mounts
        wait = WAIT_GCS.format(addr=f"{head_fqdn}:{GCS_PORT}")
        plan.init = ContainerPlan("wait-gcs-ready", container["image"],
                                  ["/bin/bash", "-c", "--", wait], dict(env), cpus=0.2,
                                  memory=256 * 2**20)
    else:
        plan.aliases = [head_fqdn, f"{cluster}-head-svc"]
    security = spec.get("securityContext", {})
    if security.get("runAsUser") is not None:
        plan.user = f"{security['runAsUser']}:{security.get('runAsGroup', 0)}"
    plan.read_only = bool(container.get("securityContext", {}).get("readOnlyRootFilesystem"))
    return plan


def _mounts(plan: PodPlan, spec: Mapping[str, Any], container: Mapping[str, Any]) -> None:
    """emptyDirs as tmpfs (Memory: /dev/shm), Secrets and PVCs by name; KubeRay's own
    /dev/shm (sized to the memory limit) when the spec mounts none."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume, path = volumes[mount["name"]], mount["mountPath"]
        if "emptyDir" in volume and path == "/dev/shm":  # noqa: S108  # a mount path, not a file
            limit = volume["emptyDir"].get("sizeLimit") or plan.ray.memory or 0
            plan.shm_bytes = int(quantity(limit))
        elif "emptyDir" in volume:
            plan.tmpfs.append(path)
        elif "secret" in volume:
            plan.secrets[path] = volume["secret"]["secretName"]
        elif "persistentVolumeClaim" in volume:
            plan.volumes[path] = volume["persistentVolumeClaim"]["claimName"]
        else:
            raise ValueError(f"volume {mount['name']}: {sorted(volume)} is not one the "
                             "harness runs; expected emptyDir, secret or persistentVolumeClaim")
    if not plan.shm_bytes:
        plan.shm_bytes = plan.ray.memory or 0


def cluster_plans(manifest: Mapping[str, Any], *, token: str,
                  secrets: Mapping[str, Mapping[str, str]]) -> tuple[PodPlan, list[PodPlan]]:
    """The head pod and every worker pod (``replicas`` x ``numOfHosts`` per group)."""
    name = manifest["metadata"]["name"]
    cluster = f"{name}-raycluster"
    config = manifest["spec"]["rayClusterConfig"]
    head = pod_plan(config["headGroupSpec"], head=True, cluster=cluster,
                    pod_name=f"{cluster}-head", token=token, secrets=secrets)
    workers = []
    for group in config.get("workerGroupSpecs", []):
        for i in range(int(group.get("replicas", 1)) * int(group.get("numOfHosts", 1))):
            workers.append(worker_plan(manifest, group["groupName"], i, token=token,
                                       secrets=secrets))
    return head, workers


def worker_plan(manifest: Mapping[str, Any], group_name: str, index: int | str, *,
                token: str, secrets: Mapping[str, Mapping[str, str]]) -> PodPlan:
    """One worker pod of a group (a replacement gets a new name from the same spec)."""
    cluster = f"{manifest['metadata']['name']}-raycluster"
    [group] = [g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
               if g["groupName"] == group_name]
    return pod_plan(group, head=False, cluster=cluster,
                    pod_name=f"{cluster}-{group_name}-worker-{index}", token=token,
                    secrets=secrets)
