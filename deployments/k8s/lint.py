"""Checks of rendered manifests: semantics against the config, security, stale files."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from deployments import serve_env
from deployments.config import (
    AppArgs,
    ConfigError,
    ServeConfig,
    checks,
    parse_app_args,
)
from deployments.config.pd import POOLS, PDAppArgs
from deployments.k8s.params import (
    CLIENT_PORT,
    DASHBOARD_PORT,
    MANIFEST_SUFFIX,
    SECRET_NAMES,
    SERVE_PORT,
    UPGRADE_TYPES,
    scaling,
)

# ------------------------------------------------------------------ checks


def semantic_problems(manifest: Mapping[str, Any]) -> list[str]:
    """What the CRD schema cannot say: enums it lacks and GPU arithmetic.

    The schema types ``upgradeStrategy.type`` as a free string and knows nothing
    of the Serve config inside ``serveConfigV2``; these checks tie the two
    together: every worker pod's ``nvidia.com/gpu`` must equal the GPUs of one
    replica divided by the pods (numOfHosts) it spans.
    """
    spec, found = manifest.get("spec", {}), []
    kind = (spec.get("upgradeStrategy") or {}).get("type")
    if kind is not None and kind not in UPGRADE_TYPES:
        found.append(f"spec.upgradeStrategy.type={kind!r}: expected one of {UPGRADE_TYPES}")
    if kind == "NewClusterWithIncrementalUpgrade" and not spec["upgradeStrategy"].get(
            "clusterUpgradeOptions"):
        found.append("spec.upgradeStrategy: NewClusterWithIncrementalUpgrade needs "
                     "clusterUpgradeOptions")
    serve = ServeConfig.model_validate(yaml.safe_load(spec["serveConfigV2"]))
    ours = [parse_app_args(a.args, a.where, refuse=False) for a in serve.applications
            if a.is_ours]
    # The preset's own policy problems (deployments.config.checks), reported with the manifest's.
    found += [f"serveConfigV2: {p.message}" for args in ours for p in checks.errors(
        checks.check(args))]
    cluster = spec["rayClusterConfig"]
    if not cluster.get("enableInTreeAutoscaling"):
        found.append("rayClusterConfig.enableInTreeAutoscaling is off: Serve autoscaling "
                     "would never get nodes")
    found += _ingress_env_problems(cluster, ours)
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    if "nvidia.com/gpu" in head.get("resources", {}).get("limits", {}):
        found.append("head group requests GPUs")
    groups = cluster["workerGroupSpecs"]
    if len(ours) == 1 and len(groups) > 1:  # a mixed fleet: one group per node type
        return found + _fleet_group_problems(groups, ours[0])
    for group, args in zip(groups, ours, strict=False):
        found.extend(_group_problems(group, args))
    return found


def _ingress_env_problems(cluster: Mapping[str, Any], ours: list[AppArgs]) -> list[str]:
    """Every pod runs the door the preset asks for (``serve_env.ingress_problem``, the
    rule the app's build applies to the Ray it runs on): Ray's HAProxy flag is read by
    each Ray process from its own environment, and HAProxy must run as dsv4-haproxy."""
    doors = sorted({args.http.ingress for args in ours}) or ["serve_proxy"]
    if len(doors) > 1:
        return [f"serveConfigV2: applications ask for different http.ingress {doors}"]
    found = []
    for where, template in _pods(cluster):
        for container in template["spec"]["containers"]:
            env = {e["name"]: e.get("value") or "" for e in container.get("env", [])}
            problem = serve_env.ingress_problem(doors[0], env)
            if problem:
                flag = env.get(serve_env.HAPROXY_FLAG)
                found.append(f"{where}: env {serve_env.HAPROXY_FLAG}={flag!r}: {problem}")
    return found


def _fleet_group_problems(groups: list[Mapping[str, Any]], args: AppArgs) -> list[str]:
    """One deployment over several groups: each holds whole replicas, the bounds add up.

    Serve's gangs land on whichever group has room, so every group must hold one
    replica exactly as ``dsv4.node`` does, and the groups' min/max pods must sum to
    Serve's min/max replicas (fewer: gangs wait forever; more: idle GPU nodes).
    """
    found = []
    if isinstance(args, PDAppArgs):
        return ["a P/D preset renders one worker group; a fleet over several GPU types is "
                "served aggregated (P/D across GPU types is refused by plan)"]
    if len(groups) != len(args.dsv4.node_types):
        found.append(f"{len(groups)} worker groups for {len(args.dsv4.node_types)} "
                     "dsv4.node_types: expected one group per node type")
    for group in groups:
        found.extend(p for p in _group_problems(group, args) if "min/maxReplicas" not in p)
    auto = args.llm.deployment_config.autoscaling_config
    low, high = (sum(int(g["minReplicas"]) for g in groups),
                 sum(int(g["maxReplicas"]) for g in groups))
    if auto is not None and (low, high) != (auto.min_replicas, auto.max_replicas):
        found.append(f"worker groups' minReplicas sum {low} and maxReplicas sum {high} != "
                     f"Serve autoscaling {auto.min_replicas}/{auto.max_replicas}")
    return found


def _pods(cluster: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    groups = [("head", cluster["headGroupSpec"])] + [
        (g.get("groupName", "worker"), g) for g in cluster.get("workerGroupSpecs", [])]
    return [(name, group["template"]) for name, group in groups]


def _container_problems(where: str, container: Mapping[str, Any]) -> list[str]:
    found = []
    image = str(container.get("image", ""))
    if not re.search(r"@sha256:[0-9a-f]{64}$", image):
        found.append(f"{where}: image {image!r} is not pinned by digest (@sha256:...)")
    ctx = container.get("securityContext") or {}
    if ctx.get("allowPrivilegeEscalation") is not False:
        found.append(f"{where}: securityContext.allowPrivilegeEscalation must be false "
                     "(the Ray image's user has passwordless sudo)")
    if ctx.get("privileged"):
        found.append(f"{where}: securityContext.privileged must not be true")
    if "ALL" not in ((ctx.get("capabilities") or {}).get("drop") or []):
        found.append(f"{where}: securityContext.capabilities.drop must include ALL")
    if ctx.get("readOnlyRootFilesystem") is not True:
        found.append(f"{where}: securityContext.readOnlyRootFilesystem is not true")
    for env in container.get("env", []):
        named_secret = SECRET_NAMES.search(env["name"]) and not env["name"].endswith("_FILE")
        if named_secret and "value" in env:
            found.append(f"{where}: env {env['name']} has a literal value; secrets come "
                         "from a Secret (valueFrom.secretKeyRef) only")
    names = {e["name"] for e in container.get("env", [])}
    if "DSV4_API_KEYS_FILE" not in names and "DSV4_API_KEYS" not in names:
        found.append(f"{where}: no DSV4_API_KEYS_FILE: the ingress would have no API key")
    return found


def _policy_problems(policy: Mapping[str, Any] | None, name: str) -> list[str]:
    if policy is None:
        return [f"{name}: no NetworkPolicy: every pod in the cluster reaches the Ray head"]
    spec, found = policy.get("spec", {}), []
    if spec.get("podSelector", {}).get("matchLabels", {}).get(
            "app.kubernetes.io/instance") != name:
        found.append(f"NetworkPolicy {policy['metadata']['name']}: podSelector does not "
                     f"select app.kubernetes.io/instance={name}")
    if "Ingress" not in spec.get("policyTypes", []):
        found.append("NetworkPolicy: policyTypes lacks Ingress")
    for i, rule in enumerate(spec.get("ingress", [])):
        ports = {p.get("port") for p in rule.get("ports", [])}
        sources = rule.get("from")
        if not sources and ports != {SERVE_PORT}:
            found.append(f"NetworkPolicy ingress[{i}]: open to every source on ports "
                         f"{sorted(ports, key=str) or 'all'}; only {SERVE_PORT} may be")
        for source in sources or []:
            if "ipBlock" in source:
                found.append(f"NetworkPolicy ingress[{i}]: ipBlock sources reach Ray ports")
            found += _source_problems(i, source)
            if DASHBOARD_PORT in ports and not (source.get("podSelector") or {}).get(
                    "matchLabels"):
                found.append(f"NetworkPolicy ingress[{i}]: port {DASHBOARD_PORT} from every "
                             "pod of a namespace; only the KubeRay operator's pods "
                             "(podSelector.matchLabels) may reach it")
    return found


def _source_problems(i: int, source: Mapping[str, Any]) -> list[str]:
    """A ``from`` element must not admit pods of every namespace.

    No ``namespaceSelector`` means the policy's own namespace. An empty one means
    every namespace: with no pod labels that is every pod; with pod labels it is
    any pod anyone labels so, in any namespace (anyone who may create a pod
    somewhere). The namespace is pinned by ``kubernetes.io/metadata.name`` (set
    by the API server, not by users) in the same element: two elements would
    be OR, not AND.
    """
    if "namespaceSelector" not in source:
        return []
    namespaces = source["namespaceSelector"] or {}
    pod_labels = (source.get("podSelector") or {}).get("matchLabels")
    if not namespaces and not pod_labels:
        return [f"NetworkPolicy ingress[{i}]: every pod of every namespace"]
    if "kubernetes.io/metadata.name" not in (namespaces.get("matchLabels") or {}):
        return [f"NetworkPolicy ingress[{i}]: pods labelled {pod_labels or '(any)'} in any "
                "namespace whose labels match; pin the namespace with namespaceSelector."
                "matchLabels kubernetes.io/metadata.name in the same from element"]
    return []


def security_problems(docs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The rules of docs/security.md on a rendered RayService + NetworkPolicy pair."""
    [service] = [d for d in docs if d.get("kind") == "RayService"]
    policy = next((d for d in docs if d.get("kind") == "NetworkPolicy"), None)
    name, spec = service["metadata"]["name"], service["spec"]
    cluster, found = spec["rayClusterConfig"], []
    if (cluster.get("authOptions") or {}).get("mode") != "token":
        found.append("rayClusterConfig.authOptions.mode is not token: the dashboard, Jobs "
                     "API and Ray Client answer anyone who reaches the head")
    for where, template in _pods(cluster):
        pod = template["spec"]
        if template.get("metadata", {}).get("labels", {}).get(
                "app.kubernetes.io/instance") != name:
            found.append(f"{where}: pods lack label app.kubernetes.io/instance={name} "
                         "(the NetworkPolicy would not select them)")
        if (pod.get("securityContext") or {}).get("runAsNonRoot") is not True:
            found.append(f"{where}: securityContext.runAsNonRoot must be true")
        for container in pod["containers"]:
            found += _container_problems(f"{where}/{container['name']}", container)
            ports = {p["containerPort"] for p in container.get("ports", [])}
            if CLIENT_PORT in ports:
                found.append(f"{where}: Ray Client port {CLIENT_PORT} is published")
    serve = ServeConfig.model_validate(yaml.safe_load(spec["serveConfigV2"]))
    for app in serve.applications:
        if app.is_ours and parse_app_args(app.args).http.auth.mode == "off":
            found.append(f"serveConfigV2 {app.name}: http.auth.mode is off")
    return found + _policy_problems(policy, name)


def _group_problems(group: Mapping[str, Any], args: AppArgs) -> list[str]:
    if isinstance(args, PDAppArgs):
        return _pd_group_problems(group, args)
    ek, node, par = args.llm.engine_kwargs, args.dsv4.node, args.parallel()
    found = []
    hosts = group.get("numOfHosts", 1)
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    per_pod = int(limits.get("nvidia.com/gpu", 0))
    if node.platform == "cpu" and per_pod:
        found.append(f"{group['groupName']}: nvidia.com/gpu {per_pod} on a CPU preset "
                     "(dsv4.node.platform cpu): the pods would wait for GPUs they never use")
    if node.platform == "cuda" and per_pod * hosts != par.gpus_per_replica:
        found.append(
            f"{group['groupName']}: nvidia.com/gpu {per_pod} x numOfHosts {hosts} != "
            f"DP {ek.data_parallel_size} x TP {ek.tensor_parallel_size} x PP "
            f"{ek.pipeline_parallel_size} = {par.gpus_per_replica}")
    if hosts != node.nodes_per_replica:
        found.append(f"{group['groupName']}: numOfHosts {hosts} != nodes_per_replica "
                     f"{node.nodes_per_replica}")
    auto = args.llm.deployment_config.autoscaling_config
    if auto is not None and (group["minReplicas"], group["maxReplicas"]) != (
            auto.min_replicas, auto.max_replicas):
        found.append(f"{group['groupName']}: min/maxReplicas {group['minReplicas']}/"
                     f"{group['maxReplicas']} != Serve autoscaling {auto.min_replicas}/"
                     f"{auto.max_replicas}")
    need = args.replica_cpus() / par.nodes
    have = _cpu_quantity(str(limits.get("cpu", "0")))
    if have < need:
        found.append(f"{group['groupName']}: cpu limit {limits.get('cpu')} < {need:g} CPUs "
                     "the replica's placement bundles need per node: Ray could never "
                     "place it and the autoscaler would add pods forever")
    return found


def _pd_group_problems(group: Mapping[str, Any], args: PDAppArgs) -> list[str]:
    """P/D: both pools' replicas fit the pods, the pod bounds hold both pools' bounds."""
    name, found = group["groupName"], []
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    per_pod = int(limits.get("nvidia.com/gpu", 0))
    if group.get("numOfHosts", 1) != 1:
        found.append(f"{name}: numOfHosts {group.get('numOfHosts')} != 1 (P/D pool "
                     "replicas live inside one pod each)")
    cpus = _cpu_quantity(str(limits.get("cpu", "0")))
    for pool in POOLS:
        gpus = args.pool_parallel(pool).gpus_per_replica
        if not per_pod or gpus > per_pod or per_pod % gpus:
            found.append(f"{name}: nvidia.com/gpu {per_pod} per pod does not hold whole "
                         f"{pool} replicas of {gpus} GPUs")
            continue
        need = per_pod // gpus * args.pool_replica_cpus(pool)
        if cpus < need:
            found.append(f"{name}: cpu limit {limits.get('cpu')} < {need:g} CPUs that "
                         f"{per_pod // gpus} {pool} replica(s) filling a pod reserve")
    try:
        _, low, high = scaling(args)
    except ConfigError as exc:
        return [*found, f"{name}: {exc}"]
    if (group["minReplicas"], group["maxReplicas"]) != (low, high):
        found.append(f"{name}: min/maxReplicas {group['minReplicas']}/{group['maxReplicas']}"
                     f" != the {low}/{high} pods both pools' Serve bounds fill")
    return found


def _cpu_quantity(value: str) -> float:
    """Kubernetes CPU quantity ("96", "500m") in cores."""
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def stale_files(out_dir: Path, rendered: Mapping[str, str]) -> list[str]:
    """Manifests that are missing, different, or no longer rendered from any preset."""
    problems = []
    for name, text in rendered.items():
        path = out_dir / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.read_text() != text:
            problems.append(f"{path}: out of date")
    for path in sorted(out_dir.glob(f"*{MANIFEST_SUFFIX}")):
        if path.name not in rendered:
            problems.append(f"{path}: not rendered from any preset in params (delete it)")
    return problems
