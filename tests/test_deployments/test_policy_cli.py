"""``dsv4-serve policy``: the operator's route to ``KVSpecController.set_policy``.

The change itself runs against a real app in ``tests/test_deployments/test_serving.py``
(``test_enforce_makes_the_differing_replica_unhealthy``); these pin the choices.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deployments.cli import main as cli
from deployments.cli import policy

CONTROLLER = "KVSpecController"


def test_the_subcommand_takes_each_policy_and_configured_clears() -> None:
    for choice in ("warn", "drain", "enforce", "configured"):
        args = cli.build_parser(["policy", choice]).parse_args(["policy", choice, "--app", "a"])
        assert (args.policy, args.app, args.address) == (choice, "a", "auto")
    assert policy.override_of("enforce") == "enforce"
    assert policy.override_of("configured") is None
    with pytest.raises(SystemExit):
        cli.build_parser(["policy", "off"]).parse_args(["policy", "off"])


def test_the_app_is_the_only_one_with_a_controller_or_named() -> None:
    apps = {"dsv4": SimpleNamespace(deployments={CONTROLLER: 1, "DSv4Ingress": 1}),
            "other": SimpleNamespace(deployments={"Foo": 1})}
    found = policy.controller_apps(apps, CONTROLLER)
    assert found == ["dsv4"]
    assert policy.pick_app(None, found, CONTROLLER) == "dsv4"
    with pytest.raises(ValueError, match=r"--app='other'.*found: \['dsv4'\].*Fix"):
        policy.pick_app("other", found, CONTROLLER)
    with pytest.raises(ValueError, match=r"2 running applications.*Fix: pass --app"):
        policy.pick_app(None, ["a", "b"], CONTROLLER)
    with pytest.raises(ValueError, match="Fix: start the app first"):
        policy.pick_app(None, [], CONTROLLER)
