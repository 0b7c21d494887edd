"""The KubeRay security rules (docs/security.md), one test per rule, on the rendered manifests.

Each rule is checked twice: the committed manifests pass it, and the same manifest
with that one thing undone fails ``security_problems`` with a message naming
it (so the check can fail, and ``dsv4-serve k8s render`` refuses such a manifest).
CRD validity of the RayService documents is ``tests/test_deployments/test_k8s.py``'s.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments.config import ConfigError, parse_app_args
from deployments.k8s.lint import security_problems
from deployments.k8s.params import (
    API_KEYS_DIR,
    CLIENT_PORT,
    DASHBOARD_PORT,
    MANIFEST_SUFFIX,
    RAY_UID,
    SERVE_PORT,
)
from deployments.k8s.render import render_all

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "k8s").glob(f"*{MANIFEST_SUFFIX}"))
Docs = list[dict[str, Any]]


def docs_of(path: Path) -> Docs:
    return list(yaml.safe_load_all(path.read_text()))


def kind(docs: Docs, name: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == name]
    return doc


def cluster(docs: Docs) -> dict[str, Any]:
    return kind(docs, "RayService")["spec"]["rayClusterConfig"]


def pods(docs: Docs) -> list[dict[str, Any]]:
    c = cluster(docs)
    return [c["headGroupSpec"]["template"]] + [g["template"] for g in c["workerGroupSpecs"]]


def containers(docs: Docs) -> list[dict[str, Any]]:
    return [ctr for pod in pods(docs) for ctr in pod["spec"]["containers"]]


@pytest.fixture(params=MANIFESTS, ids=lambda p: p.name)
def docs(request: pytest.FixtureRequest) -> Docs:
    return docs_of(request.param)


def test_committed_manifests_pass_every_rule(docs: Docs) -> None:
    assert [d["kind"] for d in docs] == ["RayService", "NetworkPolicy"]
    assert security_problems(docs) == []


def broken(docs: Docs, edit: Callable[[Docs], None]) -> list[str]:
    copy_ = copy.deepcopy(docs)
    edit(copy_)
    return security_problems(copy_)


def test_rule_token_auth(docs: Docs) -> None:
    assert cluster(docs)["authOptions"] == {"mode": "token"}
    problems = broken(docs, lambda d: cluster(d).pop("authOptions"))
    assert any("authOptions.mode is not token" in p for p in problems)
    problems = broken(docs, lambda d: cluster(d).update(authOptions={"mode": "disabled"}))
    assert any("authOptions.mode is not token" in p for p in problems)


def test_rule_ray_client_not_published(docs: Docs) -> None:
    head = cluster(docs)["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert CLIENT_PORT not in {p["containerPort"] for p in head["ports"]}

    def publish(d: Docs) -> None:
        cluster(d)["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"].append(
            {"name": "client", "containerPort": CLIENT_PORT})

    assert any("Ray Client port 10001" in p for p in broken(docs, publish))


def test_rule_network_policy_lets_in_only_the_serve_port(docs: Docs) -> None:
    policy = kind(docs, "NetworkPolicy")
    name = kind(docs, "RayService")["metadata"]["name"]
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == name
    open_rules = [r for r in policy["spec"]["ingress"] if not r.get("from")]
    assert [[p["port"] for p in r["ports"]] for r in open_rules] == [[SERVE_PORT]]
    # the dashboard (Jobs API) only from the operator, never from any pod
    [dash] = [r for r in policy["spec"]["ingress"]
              if {p["port"] for p in r.get("ports", [])} == {DASHBOARD_PORT}]
    assert dash["from"][0]["podSelector"]["matchLabels"]
    for pod in pods(docs):  # the policy selects every pod of the cluster
        assert pod["metadata"]["labels"]["app.kubernetes.io/instance"] == name

    def open_dashboard(d: Docs) -> None:
        kind(d, "NetworkPolicy")["spec"]["ingress"].append(
            {"ports": [{"port": DASHBOARD_PORT}]})

    assert any("open to every source on ports [8265]" in p
               for p in broken(docs, open_dashboard))
    assert any("no NetworkPolicy" in p for p in broken(
        docs, lambda d: d.remove(kind(d, "NetworkPolicy"))))
    assert any("every pod of every namespace" in p for p in broken(
        docs, lambda d: kind(d, "NetworkPolicy")["spec"]["ingress"][2].update(
            {"from": [{"namespaceSelector": {}}]})))
    assert any("only the KubeRay operator's pods" in p for p in broken(
        docs, lambda d: kind(d, "NetworkPolicy")["spec"]["ingress"][2]["from"][0].pop(
            "podSelector")))

    def unlabel(d: Docs) -> None:
        pods(d)[1]["metadata"]["labels"].pop("app.kubernetes.io/instance")

    assert any("NetworkPolicy would not select them" in p for p in broken(docs, unlabel))


@pytest.mark.parametrize(("field", "value", "says"), [
    ("allowPrivilegeEscalation", True, "allowPrivilegeEscalation must be false"),
    ("privileged", True, "privileged must not be true"),
    ("capabilities", {"drop": ["NET_RAW"]}, "capabilities.drop must include ALL"),
    ("readOnlyRootFilesystem", False, "readOnlyRootFilesystem is not true"),
])
def test_rule_container_security_context(docs: Docs, field: str, value: Any,
                                         says: str) -> None:
    for container in containers(docs):
        ctx = container["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == [
            "ALL"] and ctx["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/tmp", "/home/ray/.cache"} <= mounts  # writable scratch on a read-only root
    problems = broken(docs, lambda d: containers(d)[-1]["securityContext"].update(
        {field: value}))
    assert any(says in p for p in problems), problems


def test_rule_non_root(docs: Docs) -> None:
    for pod in pods(docs):
        ctx = pod["spec"]["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == RAY_UID
    problems = broken(docs, lambda d: pods(d)[0]["spec"]["securityContext"].update(
        runAsNonRoot=False))
    assert any("head: securityContext.runAsNonRoot must be true" in p for p in problems)


def test_rule_image_by_digest(docs: Docs) -> None:
    for container in containers(docs):
        assert re.search(r"@sha256:[0-9a-f]{64}$", container["image"])
    problems = broken(docs, lambda d: containers(d)[0].update(image="ray:2.60.0"))
    assert any("not pinned by digest" in p for p in problems)


def test_rule_secrets_only_from_secrets(docs: Docs) -> None:
    for container in containers(docs):
        env = {e["name"]: e for e in container["env"]}
        assert set(env["HF_TOKEN"]) == {"name", "valueFrom"}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
        assert env["DSV4_API_KEYS_FILE"]["value"].startswith(API_KEYS_DIR + "/")
    for pod in pods(docs):
        [keys] = [v for v in pod["spec"]["volumes"] if v["name"] == "api-keys"]
        assert keys["secret"] == {"secretName": "dsv4-api-keys", "optional": False,
                                  "defaultMode": 0o440}
    serve = yaml.safe_load(kind(docs, "RayService")["spec"]["serveConfigV2"])
    for app in serve["applications"]:
        env = app["args"]["llm"].get("runtime_env", {}).get("env_vars", {})
        assert not {"HF_TOKEN", "DSV4_API_KEYS", "VLLM_API_KEY"} & set(env)

    def inline(d: Docs) -> None:
        env = containers(d)[0]["env"]
        env[:] = [e for e in env if e["name"] != "HF_TOKEN"] + [
            {"name": "HF_TOKEN", "value": "hf_x"}]

    assert any("HF_TOKEN has a literal value" in p for p in broken(docs, inline))
    no_keys = broken(docs, lambda d: containers(d)[0].update(
        env=[e for e in containers(d)[0]["env"] if e["name"] != "DSV4_API_KEYS_FILE"]))
    assert any("no DSV4_API_KEYS_FILE" in p for p in no_keys)


def test_rule_presets_require_keys(docs: Docs) -> None:
    text = kind(docs, "RayService")["spec"]["serveConfigV2"]
    serve = yaml.safe_load(text)
    assert serve["http_options"]["host"] == "0.0.0.0"
    assert parse_app_args(serve["applications"][0]["args"]).http.auth.mode == "keys"

    def off(d: Docs) -> None:
        kind(d, "RayService")["spec"]["serveConfigV2"] = text.replace(
            "auth: {mode: keys}", "auth: {mode: off}")

    assert any("http.auth.mode is off" in p for p in broken(docs, off))


def test_hf_token_in_runtime_env_is_refused() -> None:
    """runtime_env is readable back through Ray's state API: a token there is echoed."""
    llm = {"model_loading_config": {"model_id": "m"},
           "runtime_env": {"env_vars": {"HF_TOKEN": "hf_secret"}}}
    with pytest.raises(ConfigError, match="HF_TOKEN is set"):
        parse_app_args({"llm": llm})


def test_render_refuses_an_insecure_manifest(tmp_path: Path) -> None:
    """Params that would open the dashboard to every pod: render fails, naming the rule."""
    params = yaml.safe_load((REPO / "k8s" / "params.yaml").read_text())
    params["kuberay_operator_labels"] = {}
    for entry in params["presets"].values():
        entry["config"] = str(REPO / "configs" / Path(entry["config"]).name)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(ConfigError, match=r"not secure:(.|\n)*only the KubeRay operator's pods"):
        render_all(path)


def test_params_say_who_reaches_metrics_as_the_policy_does(docs: Docs) -> None:
    """k8s/params.yaml's words about the metrics port match the NetworkPolicy rendered
    from it (issue 52: the words said "only from this namespace", the policy admitted
    ``metrics_namespace``)."""
    from deployments.k8s.params import METRICS_PORT

    params = yaml.safe_load((REPO / "k8s" / "params.yaml").read_text())
    comments = " ".join(line.lstrip("# ").strip() for line in
                        (REPO / "k8s" / "params.yaml").read_text().splitlines()
                        if line.startswith("#"))
    words = comments[comments.index(f"({METRICS_PORT})"):][:160]
    assert "metrics_namespace" in words and "this namespace" not in words, words
    [rule] = [r for r in kind(docs, "NetworkPolicy")["spec"]["ingress"]
              if {p["port"] for p in r.get("ports", [])} == {METRICS_PORT}]
    namespaces = [f["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                  for f in rule["from"]]
    assert namespaces == [params["metrics_namespace"]]
