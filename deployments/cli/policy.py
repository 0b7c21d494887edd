"""``dsv4-serve policy POLICY [--app NAME]``: the operator's run-time KV-spec policy.

Each replica obeys its own configured ``dsv4.policy``; changing that config is a
rolling update that reboots every engine (minutes per replica on a GPU node).
This sets an override for every replica of one running app without a restart
(e.g. ``warn`` during a rollout, ``enforce`` once it is done), or clears it
(``configured``), through ``KVSpecController.set_policy``. Unlike ``status`` it
joins the Ray cluster (a Serve handle), not the HTTP API: whoever holds an API
key for inference must not be able to switch enforcement off. Prints the report
the check after the change produced; exit codes as ``dsv4-serve status``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from deployments.cli.status import EXIT, EXIT_INCOMPLETE
from deployments.config import Policy
from deployments.control.report import describe
from deployments.control.wire import FleetReport
from deployments.serving.names import CONTROLLER_NAME

CLEAR = "configured"
CHOICES = [p.value for p in Policy] + [CLEAR]


def override_of(choice: str) -> str | None:
    """The ``set_policy`` argument for a CLI choice: ``configured`` clears the override."""
    if choice == CLEAR:
        return None
    return Policy(choice).value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("policy", choices=CHOICES,
                        help=f"the policy for every replica, or {CLEAR!r} to clear the "
                             "override (each replica obeys its own dsv4.policy)")
    parser.add_argument("--app", default=None,
                        help="the Serve application (default: the only one with a "
                             "KV-spec controller)")
    parser.add_argument("--address", default="auto",
                        help="Ray cluster address to join (default: %(default)s, the cluster "
                             "this node belongs to, e.g. inside the KubeRay head pod)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for the check after the change")


def controller_apps(applications: dict[str, Any], controller: str) -> list[str]:
    """Names of the applications (``serve.status().applications``) with our controller."""
    return sorted(name for name, app in applications.items() if controller in app.deployments)


def pick_app(requested: str | None, apps: list[str], controller: str) -> str:
    """The application to change, or a ValueError naming the choices and the fix."""
    if requested is not None:
        if requested not in apps:
            raise ValueError(f"--app={requested!r}: no running application of that name has "
                             f"a {controller} (found: {apps or 'none'}). Fix: pass one "
                             "of those names.")
        return requested
    if len(apps) != 1:
        raise ValueError(f"{len(apps)} running applications have a {controller} "
                         f"({apps or 'none'}); Fix: " + ("pass --app NAME." if apps else
                                                         "start the app first."))
    return apps[0]


def main(args: argparse.Namespace) -> int:
    import ray
    from ray import serve


    if not ray.is_initialized():
        ray.init(address=args.address, namespace="serve", log_to_driver=False)
    try:
        apps = controller_apps(serve.status().applications, CONTROLLER_NAME)
        app = pick_app(args.app, apps, CONTROLLER_NAME)
    except ValueError as exc:
        print(f"dsv4-serve policy: {exc}", file=sys.stderr)
        return 2
    handle = serve.get_deployment_handle(CONTROLLER_NAME, app)
    report = FleetReport.model_validate(
        handle.set_policy.remote(override_of(args.policy)).result(timeout_s=args.timeout))
    print(describe(report))
    return EXIT.get(report.state.value, EXIT_INCOMPLETE)
