"""RayService manifests: valid for the CRD, consistent with configs/, never stale.

The schema is KubeRay's own RayService CRD (commit feeaf72f) from
../shared/reference/kuberay/; ``kubernetes-validate`` silently skips CRDs, so the
``openAPIV3Schema`` is applied with ``jsonschema`` directly, plus the two things a
structural schema does not reject but the API server silently drops or accepts:
unknown fields (pruned) and enum values the schema types as free strings.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments.cli.k8s import add_arguments, main
from deployments.config import ConfigError, ServeConfig, load_serve_config, parse_app_args
from deployments.config.pd import POOLS, PDAppArgs
from deployments.k8s.lint import security_problems, semantic_problems, stale_files
from deployments.k8s.params import (
    DEFAULT_PARAMS,
    MANIFEST_SUFFIX,
    METRICS_PORT,
    SERVE_PORT,
    UPGRADE_TYPES,
    Preset,
    load_params,
    presets,
)
from deployments.k8s.render import render_all, render_documents, render_manifest

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
CRD = REPO.parent / "shared" / "reference" / "kuberay" / "ray.io_rayservices.yaml"
MANIFESTS = sorted(K8S.glob(f"*{MANIFEST_SUFFIX}"))
# The tiny model on CPU pods (make test-kuberay runs it): no GPUs, no GPU node selection.
CPU_MANIFESTS = [K8S / f"local-cpu{MANIFEST_SUFFIX}"]
GPU_MANIFESTS = [p for p in MANIFESTS if p not in CPU_MANIFESTS]

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    if not CRD.is_file():
        pytest.skip(f"KubeRay CRD not found at {CRD} (the shared reference directory is "
                    "absent); schema validation needs it")
    # libyaml when present: the CRD is 18k lines (17 s in pure-Python PyYAML).
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(CRD.read_text(), Loader=loader)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def _docs(path: Path) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(path.read_text()))


def _load(path: Path) -> dict[str, Any]:
    """The RayService document of a manifest (the other one is its NetworkPolicy)."""
    [doc] = [d for d in _docs(path) if d["kind"] == "RayService"]
    return doc


def _schema_errors(schema: Mapping[str, Any], doc: Mapping[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(doc)]


def pruned_fields(node: Any, schema: Mapping[str, Any], path: str = "") -> Iterator[str]:
    """Fields the API server would prune: not in a structural schema's properties."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(node, Mapping):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in node.items():
            if props is not None and key in props:
                yield from pruned_fields(value, props[key], f"{path}.{key}")
            elif isinstance(extra, Mapping):
                yield from pruned_fields(value, extra, f"{path}.{key}")
            elif props is not None:
                yield f"{path}.{key}"
    elif isinstance(node, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(node):
            yield from pruned_fields(item, schema["items"], f"{path}[{i}]")


def test_manifests_exist_for_every_preset_in_params():
    params = load_params()
    assert sorted(p.name for p in MANIFESTS) == sorted(
        f"{name}{MANIFEST_SUFFIX}" for name in params["presets"])
    # four one-pool V4 GPU presets + the P/D one; V4.1 on H200, on B200, and both mixed;
    # the tiny model on CPU pods (make test-kuberay)
    assert len(MANIFESTS) == 9


def test_committed_manifests_are_up_to_date():
    assert stale_files(K8S, render_all()) == [], "run: dsv4-serve k8s render"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_the_crd(path, schema):
    doc = _load(path)
    assert _schema_errors(schema, doc) == []
    assert list(pruned_fields(doc, schema)) == []


def test_schema_checks_can_fail(schema):
    doc = _load(MANIFESTS[0])
    group = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["maxReplicas"] = "four"
    group["numOfHost"] = 2  # typo: the API server would drop it silently
    assert any("maxReplicas" in e for e in _schema_errors(schema, doc))
    assert list(pruned_fields(doc, schema)) == [
        ".spec.rayClusterConfig.workerGroupSpecs[0].numOfHost"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_semantics(path):
    doc = _load(path)
    assert semantic_problems(doc) == []
    spec = doc["spec"]
    assert spec["upgradeStrategy"]["type"] in UPGRADE_TYPES
    cluster = spec["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["rayVersion"] == "2.60.0"


def test_semantic_checks_can_fail():
    doc = _load(K8S / "pro-h200-2node.rayservice.yaml")
    doc["spec"]["upgradeStrategy"]["type"] = "BlueGreen"
    group = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    group["numOfHosts"] = 1
    problems = semantic_problems(doc)
    assert any("BlueGreen" in p for p in problems)
    assert any("numOfHosts 1" in p for p in problems)
    group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "16"
    assert any("cpu limit 16 < 64.5 CPUs" in p for p in semantic_problems(doc))
    doc["spec"]["upgradeStrategy"]["type"] = "NewClusterWithIncrementalUpgrade"
    assert any("clusterUpgradeOptions" in p for p in semantic_problems(doc))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_serve_config_is_the_preset_and_parses(path):
    doc = _load(path)
    text = doc["spec"]["serveConfigV2"]
    entry = load_params()["presets"][path.name.replace(MANIFEST_SUFFIX, "")]
    assert text == (K8S / entry["config"]).read_text()
    serve = ServeConfig.model_validate(yaml.safe_load(text))
    (app,) = [a for a in serve.applications if a.is_ours]
    args = parse_app_args(app.args)
    assert args.llm.engine_kwargs.kv_cache_dtype == "auto"
    assert args.llm.deployment_config.autoscaling_config is not None  # serve autoscaling


@pytest.mark.parametrize("path", GPU_MANIFESTS, ids=lambda p: p.name)
def test_gpu_limits_match_the_parallel_layout(path):
    doc = _load(path)
    serve = ServeConfig.model_validate(yaml.safe_load(doc["spec"]["serveConfigV2"]))
    args = parse_app_args(serve.applications[0].args)
    ek = args.llm.engine_kwargs
    cluster = doc["spec"]["rayClusterConfig"]
    groups = cluster["workerGroupSpecs"]
    # one group, or one per node type of a mixed fleet (each holds whole replicas)
    assert len(groups) == max(1, len(args.dsv4.node_types))
    for group in groups:
        container = group["template"]["spec"]["containers"][0]
        limits = container["resources"]["limits"]
        per_pod = int(limits["nvidia.com/gpu"])
        hosts = group.get("numOfHosts", 1)
        tp, pp, dp = (ek.tensor_parallel_size, ek.pipeline_parallel_size,
                      ek.data_parallel_size)
        if isinstance(args, PDAppArgs):  # both pools' replicas share whole-node pods
            assert (per_pod, hosts) == (args.dsv4.node.gpus_per_node, 1)
            assert all(per_pod % args.pool_parallel(p).gpus_per_replica == 0 for p in POOLS)
        elif dp > 1:
            assert per_pod == dp * tp * pp  # one DP gang per node
        else:
            assert per_pod * hosts == tp * pp  # one engine across numOfHosts nodes
            assert per_pod == tp  # TP stays inside a node, PP crosses nodes
        assert container["resources"]["requests"]["nvidia.com/gpu"] == limits[
            "nvidia.com/gpu"]
    head = cluster["headGroupSpec"]
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"][
        "limits"]
    assert head["rayStartParams"]["num-gpus"] == "0"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_pod_plumbing(path):
    doc = _load(path)
    cluster = doc["spec"]["rayClusterConfig"]
    spec = cluster["workerGroupSpecs"][0]["template"]["spec"]
    container = spec["containers"][0]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and mounts["dshm"] == "/dev/shm"
    assert "persistentVolumeClaim" in volumes["model-cache"]
    env = {e["name"]: e for e in container["env"]}
    assert mounts["model-cache"] == env["HF_HOME"]["value"]
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
    assert "value" not in env["HF_TOKEN"]
    if path in GPU_MANIFESTS:
        assert spec["nodeSelector"] and spec["tolerations"]
    assert any(p["containerPort"] == METRICS_PORT for p in container["ports"])
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {p["name"] for p in head["ports"]} == {"serve", "metrics", "dashboard", "gcs"}
    # readiness is KubeRay's injected raylet + Serve-proxy probe (see deployments/py)
    assert "readinessProbe" not in container and "readinessProbe" not in head
    assert doc["spec"]["serveService"]["spec"]["ports"][0]["port"] == SERVE_PORT
    assert not re.search(r"hf_[A-Za-z0-9]{20,}", path.read_text())  # no inline token


def test_worker_group_follows_serve_autoscaling():
    for path in MANIFESTS:
        doc = _load(path)
        serve = ServeConfig.model_validate(yaml.safe_load(doc["spec"]["serveConfigV2"]))
        args = parse_app_args(serve.applications[0].args)
        auto = args.llm.deployment_config.autoscaling_config
        groups = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        assert all(g["numOfHosts"] == args.dsv4.node.nodes_per_replica for g in groups)
        if isinstance(args, PDAppArgs):  # pods, not Serve replicas: test_pd_preset_...
            continue
        # a mixed fleet's groups share one deployment: their bounds add up to Serve's
        assert (sum(g["minReplicas"] for g in groups), sum(g["maxReplicas"] for g in groups)
                ) == (auto.min_replicas, auto.max_replicas)
    pro = _load(K8S / "pro-h200-2node.rayservice.yaml")
    assert pro["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["numOfHosts"] == 2


def _pd_preset(tmp_path: Path, change: Any = None) -> Preset:
    """The P/D preset as params list it, optionally with its Serve config changed."""
    params = load_params()
    [preset] = [p for p in presets(params, DEFAULT_PARAMS) if p.name == "flash-h200-pd"]
    if change is None:
        return preset
    raw = yaml.safe_load(preset.config_path.read_text())
    change(raw["applications"][0]["args"])
    path = tmp_path / "flash-h200-pd.yaml"
    path.write_text(yaml.safe_dump(raw))
    return Preset(preset.name, path, preset.worker)


def test_pd_preset_renders_checks_and_packs_both_pools(tmp_path):
    """configs/flash-h200-pd.yaml through `k8s render`: a TP4 prefill and a TP4 decode
    replica share each 8-GPU pod, so 1-2 replicas per pool are 1-2 pods; secure."""
    params = load_params()
    docs = render_documents(_pd_preset(tmp_path), params)  # raises on any problem
    service = docs[0]
    assert security_problems(docs) == [] and semantic_problems(service) == []
    (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"],
            group["numOfHosts"]) == (1, 1, 2, 1)
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "8"
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    args = parse_app_args(serve["applications"][0]["args"])
    assert isinstance(args, PDAppArgs) and args.http.auth.mode == "keys"  # 0.0.0.0: a key
    assert serve["http_options"]["host"] == "0.0.0.0"
    # The checks can fail: pod bounds that do not follow both pools, a starved pod.
    group["maxReplicas"] = 4
    limits["cpu"] = "32"
    problems = semantic_problems(service)
    assert any("min/maxReplicas 1/4 != the 1/2 pods" in p for p in problems), problems
    assert any("cpu limit 32 < 66 CPUs that 2 prefill replica(s)" in p for p in problems)
    # Serve's bounds change the pods: decode up to 5 -> (2 + 5) x 4 GPUs = 4 pods.
    five = _pd_preset(tmp_path, lambda a: a["pd"].update(decode={"deployment_config": {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 5}}}))
    group = render_manifest(five, params)["spec"]["rayClusterConfig"][
        "workerGroupSpecs"][0]
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 4)
    # A pool size that does not pack 8-GPU pods is refused with the fix.
    tp3 = _pd_preset(tmp_path, lambda a: a["pd"].update(prefill={"engine_kwargs": {
        "tensor_parallel_size": 3}}))
    with pytest.raises(ConfigError, match=r"\[3, 4\] GPUs on 8-GPU nodes.*Fix"):
        render_manifest(tp3, params)
    # Secure by default: the same preset without API keys is not rendered.
    keyless = _pd_preset(tmp_path, lambda a: a["http"].update(auth={"mode": "off"}))
    with pytest.raises(ConfigError, match="not secure"):
        render_documents(keyless, params)


def test_refused_preset_cannot_be_rendered():
    preset = Preset("rows", REPO / "configs" / "flash-b200-flashinfer-rows.yaml", {})
    with pytest.raises(ConfigError, match="expected_layout"):
        render_manifest(preset, load_params())


def test_cpu_preset_renders_cpu_pods():
    """The CPU preset: the cpu stack's image, no GPUs anywhere, its own small head, and
    the worker's CPUs hold one replica (its actor's CPU plus its engine bundle's)."""
    doc = _load(K8S / f"local-cpu{MANIFEST_SUFFIX}")
    cluster = doc["spec"]["rayClusterConfig"]
    stack = load_params()["stacks"]["cpu"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in pods:
        container = group["template"]["spec"]["containers"][0]
        assert container["image"] == f"{stack['image']}@{stack['image_digest']}"
        assert "nvidia.com/gpu" not in container["resources"]["limits"]
    [worker] = cluster["workerGroupSpecs"]
    assert worker["groupName"] == "cpu-local-cpu" and worker["replicas"] == 2
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert semantic_problems(doc) == []
    worker["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "1"
    assert any("cpu limit 1 < 2 CPUs" in p for p in semantic_problems(doc))
    worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"
    assert any("on a CPU preset" in p for p in semantic_problems(doc))


def test_bad_params_name_the_fix(tmp_path):
    params = yaml.safe_load((K8S / "params.yaml").read_text())
    params["image_digest"] = "latest"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(ConfigError, match="buildx imagetools inspect"):
        load_params(path)
    params["image_digest"] = "sha256:" + "a" * 64
    params["upgrade_strategy"] = "BlueGreen"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(ConfigError, match="expected one of NewCluster"):
        load_params(path)


def _cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_check_passes_then_fails_on_a_stale_copy(tmp_path, capsys):
    assert main(_cli("check")) == 0
    assert main(_cli("render", "--out", str(tmp_path))) == 0
    assert main(_cli("check", "--out", str(tmp_path))) == 0
    stale = tmp_path / "flash-h200.rayservice.yaml"
    stale.write_text(stale.read_text().replace("maxReplicas: 4", "maxReplicas: 5"))
    (tmp_path / "old.rayservice.yaml").write_text("kind: RayService\n")
    capsys.readouterr()
    assert main(_cli("render", "--check", "--out", str(tmp_path))) == 1
    err = capsys.readouterr().err
    assert "flash-h200.rayservice.yaml: out of date" in err
    assert "old.rayservice.yaml: not rendered" in err


def test_cli_render_writes_each_presets_pod_monitor_beside_it(tmp_path):
    from deployments.k8s.monitoring import render_monitors

    assert main(_cli("render", "--out", str(tmp_path))) == 0
    monitors = render_monitors()
    assert monitors
    for name, text in monitors.items():
        assert (tmp_path / "monitoring" / name).read_text() == text
        assert (tmp_path / name.replace(".podmonitor.yaml", ".rayservice.yaml")).is_file()
    (tmp_path / "monitoring" / next(iter(monitors))).write_text("kind: PodMonitor\n")
    assert main(_cli("check", "--out", str(tmp_path))) == 1
    assert main(_cli("check", "--no-monitors", "--out", str(tmp_path))) == 0
    bare = tmp_path / "bare"
    assert main(_cli("render", "--no-monitors", "--out", str(bare))) == 0
    assert not (bare / "monitoring").exists()


# ------------------------------------------------------------------ Dockerfile


def _pyproject_pin(name: str) -> str:
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(rf'"{re.escape(name)}==([0-9.]+)"', text)
    assert match, f"{name} pin not found in pyproject.toml"
    return match.group(1)


def test_dockerfile_base_image_and_install():
    text = (REPO / "Dockerfile").read_text()
    ray = _pyproject_pin("ray[llm]")
    froms = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    # ray-llm images of current Ray are Python 3.12 + CUDA 13.0 only
    # (ray-project/ray docker/ray-llm/Dockerfile).
    # (The cpu target first: its base is the mmdebstrap image, make image.)
    assert froms == ["${CPU_BASE}", f"rayproject/ray-llm:{ray}-py312-cu130"]
    assert re.search(rf"^ARG RAY_VERSION={re.escape(ray)}$", text, flags=re.M)
    assert re.search(rf"^ARG VLLM_VERSION={re.escape(_pyproject_pin('vllm'))}$", text,
                     flags=re.M)
    assert load_params()["ray_version"] == ray
    runs = re.findall(r"^RUN pip install (.*)$", text, flags=re.M)
    # The stack from its lock (hashes, the closure: no resolution), then the package.
    assert any("--no-deps --require-hashes -r /tmp/dsv4-lock.txt" in r for r in runs), runs
    assert any("--no-deps" in r and "/home/ray/dsv4-serve" in r for r in runs), runs
    assert "vllm.general_plugins" in text  # the build proves the plugin is registered


def test_dockerfile_copies_what_the_package_needs():
    text = (REPO / "Dockerfile").read_text()
    sources = [s for line in re.findall(r"^COPY\s+(?:--\S+\s+)*(.+)$", text, flags=re.M)
               for s in line.split()[:-1]]
    # configs/ and k8s/ ship in the wheel as package data (pyproject package-dir).
    assert {"pyproject.toml", "dsv4_patch", "deployments", "configs", "k8s"} <= set(sources)
    # The lock COPY names the stack by build arg: every GPU stack's lock must exist.
    expanded = [s.replace("${DSV4_EXTRA}", stack) for s in sources
                for stack in ("gpu", "gpu-v41", "gpu-v41-034")]
    missing = sorted({s for s in expanded if not (REPO / s).exists()})
    assert missing == [], f"COPY sources missing from the repository: {missing}"
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and not set(sources) & set(ignored)


def test_dsv4_serve_cli_dispatches_k8s_check(capsys):
    from deployments.cli import main as cli

    assert cli.main(["k8s", "check"]) == 0
    assert cli.main(["k8s", "render", "--check"]) == 0


# ------------------------------------------------------------------ DeepSeek-V4.1


def test_mixed_fleet_renders_one_worker_group_per_gpu_type():
    """v41-flash-mixed: an H200 and a B200 group, each its node type's GPUs and selector."""
    doc = _load(K8S / "v41-flash-mixed.rayservice.yaml")
    groups = {g["groupName"]: g for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert sorted(groups) == ["gpu-v41-flash-mixed-sm100", "gpu-v41-flash-mixed-sm90"]
    products = {name: g["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"]
                for name, g in groups.items()}
    assert products == {"gpu-v41-flash-mixed-sm90": "NVIDIA-H200",
                        "gpu-v41-flash-mixed-sm100": "NVIDIA-B200"}
    assert all((g["minReplicas"], g["maxReplicas"]) == (1, 4) for g in groups.values())
    # every group's bounds checked: the sum must be Serve's 2..8
    groups["gpu-v41-flash-mixed-sm90"]["maxReplicas"] = 2
    assert any("maxReplicas sum 6" in p and "2/8" in p for p in semantic_problems(doc))


def test_v41_presets_run_the_v41_stack_image_on_every_pod():
    params = load_params()
    v41 = params["stacks"]["gpu-v41-034"]
    for name in ("v41-flash-h200", "v41-flash-b200", "v41-flash-mixed"):
        cluster = _load(K8S / f"{name}{MANIFEST_SUFFIX}")["spec"]["rayClusterConfig"]
        pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        images = {p["template"]["spec"]["containers"][0]["image"] for p in pods}
        assert images == {f"{v41['image']}@{v41['image_digest']}"}
    flash = _load(K8S / "flash-h200.rayservice.yaml")["spec"]["rayClusterConfig"]
    assert flash["headGroupSpec"]["template"]["spec"]["containers"][0]["image"].startswith(
        params["image"] + "@")


def _lock_pins(stack: str) -> dict[str, str]:
    text = (REPO / "scripts" / "locks" / f"{stack}.txt").read_text()
    return dict(re.findall(r"^([\w.\-]+)==(\S+) ", text, re.M))


def test_each_v41_stack_is_one_release_everywhere():
    """pyproject's gpu-v41 extra, its lock and k8s/params.yaml's gpu-v41 stack name one
    vLLM; the gpu-v41-034 lock and stack another, and the presets the one their stack
    runs: 0.33 and 0.34 pools never transfer (NIXL connector 15 vs 16), and vLLM 0.33+'s
    NIXL worker refuses nixl < 1.5.0 (check_nixl_version). The Dockerfile installs a lock."""
    # Read as text: tomllib is 3.11+, and the project supports 3.10.
    block = re.search(r"^gpu-v41 = \[(.*?)^\]", (REPO / "pyproject.toml").read_text(),
                      re.M | re.S)
    assert block is not None
    pins = dict(re.findall(r'"([\w\-]+)==([\d.]+)"', block.group(1)))
    stacks = load_params()["stacks"]
    assert pins["vllm"] == stacks["gpu-v41"]["vllm_version"] == _lock_pins("gpu-v41")["vllm"]
    for stack in ("gpu-v41", "gpu-v41-034"):
        locked = _lock_pins(stack)
        assert locked["vllm"] == stacks[stack]["vllm_version"], stack
        assert locked["nixl"] == pins["nixl"], stack
        assert tuple(int(x) for x in locked["nixl"].split(".")) >= (1, 5, 0)
    preset_stacks = {p.name: p.stack for p in presets(load_params(), DEFAULT_PARAMS)}
    for name in ("v41-flash-h200", "v41-flash-b200", "v41-flash-mixed"):
        (_, args), = load_serve_config(REPO / "configs" / f"{name}.yaml").ours()
        stack = preset_stacks[name]
        assert stack is not None and args.dsv4.vllm_version == stacks[stack]["vllm_version"]
    assert "-r /tmp/dsv4-lock.txt" in (REPO / "Dockerfile").read_text()


def test_v41_preset_on_the_default_stack_is_not_rendered():
    """dsv4.vllm_version 0.34.0 on the 0.29 image: plan's prediction would not be what runs."""
    params = load_params()
    [preset] = [p for p in presets(params, DEFAULT_PARAMS) if p.name == "v41-flash-h200"]
    with pytest.raises(ConfigError, match=r"vllm_version='0.34.0'.*vLLM 0.29.0.*Fix:"):
        render_documents(Preset(preset.name, preset.config_path, preset.worker), params)


def test_mixed_preset_workers_must_match_node_types():
    params = load_params()
    [preset] = [p for p in presets(params, DEFAULT_PARAMS) if p.name == "v41-flash-mixed"]
    only_h200 = {"sm90": preset.workers["sm90"]}
    with pytest.raises(ConfigError, match=r"node types \['sm90'\].*Fix:"):
        render_documents(Preset(preset.name, preset.config_path, {}, only_h200,
                                preset.stack), params)
