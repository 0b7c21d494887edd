"""The NetworkPolicy admits the dashboard port only from the operator's own namespace.

Issue 26: the 8265 rule matched ``app.kubernetes.io/name: kuberay-operator`` with an
empty ``namespaceSelector`` (every namespace): anyone who may create a pod anywhere
could label it so and reach the dashboard/Jobs API. The lint rule fails on that
manifest, on a split (OR) rule and on a namespace chosen by user labels; the
committed manifests pin ``kubernetes.io/metadata.name``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments.k8s.lint import security_problems
from deployments.k8s.params import DASHBOARD_PORT, MANIFEST_SUFFIX

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "k8s").glob(f"*{MANIFEST_SUFFIX}"))
OPERATOR = {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}


def _dashboard_rule(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy"]
    [rule] = [r for r in policy["spec"]["ingress"]
              if {p["port"] for p in r.get("ports", [])} == {DASHBOARD_PORT}]
    return rule


@pytest.fixture(params=MANIFESTS, ids=lambda p: p.name)
def docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(request.param.read_text()))


def test_committed_rule_pins_the_operator_namespace(docs: list[dict[str, Any]]) -> None:
    params = yaml.safe_load((REPO / "k8s" / "params.yaml").read_text())
    [source] = _dashboard_rule(docs)["from"]
    assert source["namespaceSelector"] == {"matchLabels": {
        "kubernetes.io/metadata.name": params["kuberay_operator_namespace"]}}
    assert source["podSelector"] == {"matchLabels": params["kuberay_operator_labels"]}


@pytest.mark.parametrize("sources", [
    [{"namespaceSelector": {}, "podSelector": OPERATOR}],  # the old rule
    [{"namespaceSelector": {"matchLabels": {"team": "ops"}}, "podSelector": OPERATOR}],
    # OR, not AND: the namespace element alone admits every pod of kuberay-system,
    # and the labels element (no namespaceSelector: this namespace) is another way in
    [{"namespaceSelector": {"matchLabels": {"team": "ops"}}}, {"podSelector": OPERATOR}],
])
def test_lint_refuses_an_unpinned_namespace(docs: list[dict[str, Any]],
                                            sources: list[dict[str, Any]]) -> None:
    broken = copy.deepcopy(docs)
    _dashboard_rule(broken)["from"] = sources
    problems = security_problems(broken)
    assert any("in any namespace" in p and "kubernetes.io/metadata.name" in p
               for p in problems), problems
