"""RayService manifests rendered from ``configs/`` and ``k8s/params.yaml``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from deployments.config import (
    AppArgs,
    ConfigError,
    NodeSpec,
)
from deployments.http import proxy_gate
from deployments.k8s.lint import security_problems, semantic_problems
from deployments.k8s.params import (
    API_KEYS_DIR,
    DASHBOARD_PORT,
    DEFAULT_PARAMS,
    HEAD_PORTS,
    HEADER,
    MANIFEST_SUFFIX,
    METRICS_PORT,
    RAY_GID,
    RAY_UID,
    REPO_ROOT,
    SERVE_PORT,
    WRITABLE_DIRS,
    Preset,
    gpu_args,
    ingress_env,
    load_params,
    presets,
    scaling,
    stack_image,
    stack_problems,
    store_env,
    store_problems,
)

# A checkout's top level, or the wheel's deployments/_data (deployments.resources).

def image_ref(params: Mapping[str, Any], preset: Preset | None = None) -> str:
    """The image by digest (``name[:tag]@sha256:...``): what runs is what was tested.

    A preset with a ``stack`` (DeepSeek-V4.1: the gpu-v41 image) runs that stack's
    image on every pod: Ray needs the same Ray and vLLM on the head and the workers.
    """
    if preset is None:
        return f"{params['image']}@{params['image_digest']}"
    image, digest, _ = stack_image(params, preset)
    return f"{image}@{digest}"


def _env(params: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Pod env: secrets only by reference (never a value in the manifest or runtime_env)."""
    secret = params["hf_token_secret"]
    ref = {"secretKeyRef": {"name": secret["name"], "key": secret["key"], "optional": True}}
    keys = params["api_keys_secret"]
    return [
        {"name": "HF_TOKEN", "valueFrom": ref},
        {"name": "HF_HOME", "value": params["model_cache_mount"]},
        # The ingress (any pod) re-reads this file: a Secret update rotates keys live.
        {"name": "DSV4_API_KEYS_FILE", "value": f"{API_KEYS_DIR}/{keys['key']}"},
    ]


def pod_security_context() -> dict[str, Any]:
    """Non-root (the image's user has passwordless sudo), default seccomp."""
    return {"runAsNonRoot": True, "runAsUser": RAY_UID, "runAsGroup": RAY_GID,
            "fsGroup": RAY_GID, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict[str, Any]:
    """No privilege escalation (sudo is setuid), no capabilities, read-only root."""
    return {"allowPrivilegeEscalation": False, "privileged": False,
            "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True}


def _secure_pod(spec: dict[str, Any], params: Mapping[str, Any]) -> None:
    """Security context, writable scratch dirs and the API-key Secret on one pod spec."""
    spec["securityContext"] = pod_security_context()
    keys = params["api_keys_secret"]
    spec.setdefault("volumes", [])
    spec["volumes"] += [{"name": name, "emptyDir": {}} for name in WRITABLE_DIRS]
    spec["volumes"].append({"name": "api-keys", "secret": {
        "secretName": keys["name"], "optional": False, "defaultMode": 0o440}})
    for container in spec["containers"]:
        container["securityContext"] = container_security_context()
        container.setdefault("volumeMounts", [])
        container["volumeMounts"] = [
            *({"name": n, "mountPath": p} for n, p in WRITABLE_DIRS.items()),
            {"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True},
            *container["volumeMounts"]]


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "dsv4-serve", "app.kubernetes.io/instance": name}


def _resources(cpu: str, memory: str, gpus: int | None = None) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": str(cpu), "memory": str(memory)}
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def head_group(params: Mapping[str, Any], name: str,
               image: str | None = None, head: Mapping[str, Any] | None = None
               ) -> dict[str, Any]:
    """Head: GCS, dashboard, Serve controller and a proxy; no GPU, no Ray CPUs.

    ``dashboard-host: 0.0.0.0`` because the KubeRay operator posts serveConfigV2 to
    the dashboard through the head Service; token auth and the NetworkPolicy
    (operator pods only) are what close it. ``head``: a preset's own size.
    """
    head = head or params["head"]
    ports = [{"name": k, "containerPort": v, "protocol": "TCP"} for k, v in HEAD_PORTS.items()]
    spec: dict[str, Any] = {"containers": [{
        "name": "ray-head",
        "image": image or image_ref(params),
        "ports": ports,
        "env": _env(params),
        "resources": _resources(head["cpu"], head["memory"]),
    }]}
    _placement(spec, head)
    _secure_pod(spec, params)
    return {
        "rayStartParams": {"num-cpus": "0", "num-gpus": "0", "dashboard-host": "0.0.0.0",  # noqa: S104  # inside the pod; the lint holds it to the pod
                           "metrics-export-port": str(METRICS_PORT)},
        "template": {"metadata": {"labels": _labels(name)}, "spec": spec},
    }


def _placement(spec: dict[str, Any], where: Mapping[str, Any]) -> None:
    if where.get("node_selector"):
        spec["nodeSelector"] = dict(where["node_selector"])
    if where.get("tolerations"):
        spec["tolerations"] = [dict(t) for t in where["tolerations"]]


def worker_groups(preset: Preset, args: AppArgs,
                  params: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One group, or one per node type of a mixed fleet (``presets.<name>.workers``).

    A mixed fleet's groups share the Serve deployment: each group's bounds are its
    own (params), and the lint checks they add up to Serve's.
    """
    if not preset.workers:
        return [worker_group(preset, args, params)]
    types = args.dsv4.node_types
    if set(preset.workers) != set(types):
        raise ConfigError(
            f"presets.{preset.name}.workers has node types {sorted(preset.workers)} but "
            f"{preset.config_path.name} dsv4.node_types has {sorted(types)}; expected the "
            "same: one worker group per node type. Fix: list the same keys in both.")
    groups = []
    for key, worker in preset.workers.items():
        missing = [k for k in ("min_replicas", "max_replicas") if k not in worker]
        if missing:
            raise ConfigError(
                f"presets.{preset.name}.workers.{key} lacks {', '.join(missing)}: a mixed "
                "fleet's group bounds are per node type. Fix: set both (their sums must "
                "equal the preset's Serve autoscaling bounds).")
        low, high = int(worker["min_replicas"]), int(worker["max_replicas"])
        groups.append(worker_group(preset, args, params, node=types[key], worker=worker,
                                   suffix=f"-{key}", bounds=(low, low, high)))
    return groups


def worker_group(preset: Preset, args: AppArgs, params: Mapping[str, Any], *,
                 node: NodeSpec | None = None, worker: Mapping[str, Any] | None = None,
                 suffix: str = "",
                 bounds: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """One pod per GPU node; a replica is ``nodes_per_replica`` pods (numOfHosts)."""
    node, worker = node or args.dsv4.node, worker or preset.worker
    initial, low, high = bounds or scaling(args)
    container = {
        "name": "ray-worker",
        "image": image_ref(params, preset),
        "env": _env(params),
        "ports": [{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "resources": _resources(worker["cpu"], worker["memory"], node.gpus_per_node),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},  # noqa: S108  # the pod's shared-memory mount
            {"name": "model-cache", "mountPath": params["model_cache_mount"]},
        ],
    }
    spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": worker["shm"]}},
            {"name": "model-cache", **dict(params["model_cache_volume"])},
        ],
    }
    _placement(spec, worker)
    _secure_pod(spec, params)
    return {
        "groupName": f"{'gpu' if node.gpus_per_node else 'cpu'}-{preset.name}{suffix}",
        "replicas": initial,
        "minReplicas": low,
        "maxReplicas": high,
        "numOfHosts": node.nodes_per_replica,
        "rayStartParams": {"metrics-export-port": str(METRICS_PORT)},
        "template": {"metadata": {"labels": _labels(f"dsv4-{preset.name}")}, "spec": spec},
    }


def network_policy(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Ingress to the cluster's pods: Ray among themselves; from elsewhere only the API.

    Ray's processes talk on many ports (GCS, raylets, object manager, workers), so
    pods of this instance reach each other on all of them. From outside: the
    serve port from anyone (API keys guard it), the dashboard only from the
    KubeRay operator's pods *in the operator's namespace* (it posts serveConfigV2;
    token auth guards it too; a label alone can be put on a pod in any namespace),
    metrics only from the monitoring namespace. Ray Client, the Jobs API and the
    GCS are not reachable from any other pod.
    """
    selector = {"matchLabels": _labels(name)}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": _labels(name)},
        "spec": {
            "podSelector": selector,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": selector}]},
                {"ports": [{"port": SERVE_PORT, "protocol": "TCP"}]},
                {"from": [{"namespaceSelector": {"matchLabels": {
                               "kubernetes.io/metadata.name":
                                   params["kuberay_operator_namespace"]}},
                           "podSelector": {"matchLabels": dict(
                               params["kuberay_operator_labels"])}}],
                 "ports": [{"port": DASHBOARD_PORT, "protocol": "TCP"}]},
                {"from": [{"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": params["metrics_namespace"]}}}],
                 "ports": [{"port": METRICS_PORT, "protocol": "TCP"}]},
            ],
        },
    }


def render_documents(preset: Preset, params: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The RayService and its NetworkPolicy; refuses to render an insecure or
    inconsistent pair (``security_problems``, ``semantic_problems``: every render and
    every ``dsv4-serve k8s check`` runs both)."""
    name = f"dsv4-{preset.name}"
    docs = [render_manifest(preset, params), network_policy(name, params)]
    problems = security_problems(docs)
    if problems:
        raise ConfigError(f"{preset.name}: the rendered manifest is not secure:\n  "
                          + "\n  ".join(problems))
    args = gpu_args(preset.config_path)[1]
    problems = semantic_problems(docs[0]) + stack_problems(preset, args, params) + \
        store_problems(args, preset.config_path)
    if problems:
        raise ConfigError(f"{preset.name}: the rendered manifest contradicts its preset:\n  "
                          + "\n  ".join(problems))
    return docs


def render_manifest(preset: Preset, params: Mapping[str, Any]) -> dict[str, Any]:
    """The RayService for one preset (a plain dict, ready for YAML)."""
    serve_text, args = gpu_args(preset.config_path)
    name = f"dsv4-{preset.name}"
    security = container_security_context()
    head, workers = head_group(params, name, image_ref(params, preset), preset.head), \
        worker_groups(preset, args, params)
    # any pod may hold a replica (the store) or Ray's proxy (its /-/routes: the key;
    # no DSV4_PROXY_HOST there, so it counts as reachable)
    for group in (head, *workers):
        for container in group["template"]["spec"]["containers"]:
            container["env"] += store_env(args, params) + ingress_env(args) + [
                {"name": k, "value": v} for k, v in proxy_gate.proxy_gate_env().items()]
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name, "labels": _labels(name)},
        "spec": {
            "upgradeStrategy": {"type": params["upgrade_strategy"]},
            "serveService": {
                "metadata": {"name": f"{name}-serve"},
                "spec": {"type": "ClusterIP", "ports": [
                    {"name": "serve", "port": SERVE_PORT, "targetPort": SERVE_PORT}]},
            },
            "serveConfigV2": serve_text,  # verbatim: the preset's comments cite sources
            "rayClusterConfig": {
                "rayVersion": str(params["ray_version"]),
                # Ray token auth: dashboard, Jobs API, Ray Client and GCS need the
                # token KubeRay generates into a Secret; nothing answers without it.
                "authOptions": {"mode": "token"},
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {
                    "upscalingMode": "Default",
                    "idleTimeoutSeconds": int(params.get("autoscaler_idle_timeout_s", 600)),
                    # the sidecar KubeRay injects: same restrictions (its root fs stays
                    # writable: it writes Ray's session files under /tmp)
                    "securityContext": security | {"readOnlyRootFilesystem": False},
                },
                "headGroupSpec": head,
                "workerGroupSpecs": workers,
            },
        },
    }


def _block_str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    """Multi-line strings (serveConfigV2) as literal blocks, the way humans read them."""
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # no &id001 anchors: people read these
        return True


_Dumper.add_representer(str, _block_str)


def manifest_text(preset: Preset, params: Mapping[str, Any]) -> str:
    """The file content: generated-file header plus the YAML document."""
    rel = preset.config_path.relative_to(REPO_ROOT) if preset.config_path.is_relative_to(
        REPO_ROOT) else preset.config_path
    header = HEADER.format(config=rel, secret=params["hf_token_secret"]["name"],
                           keys=params["api_keys_secret"]["name"])
    body = yaml.dump_all(render_documents(preset, params), Dumper=_Dumper, sort_keys=False,
                         width=100, explicit_start=True)
    return header + body


def render_all(params_path: Path = DEFAULT_PARAMS) -> dict[str, str]:
    """File name -> content for every preset in params."""
    params = load_params(params_path)
    return {f"{p.name}{MANIFEST_SUFFIX}": manifest_text(p, params)
            for p in presets(params, params_path)}
