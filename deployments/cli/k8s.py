"""``dsv4-serve k8s render|check``: write the manifests, or check the committed ones.

Each preset's PodMonitor (``deployments.k8s.monitoring``) is rendered with its RayService
into ``<out>/monitoring/`` (``--no-monitors`` skips it), so the scrape config never lags
the manifest it scrapes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deployments.config import (
    ConfigError,
)
from deployments.k8s.lint import stale_files
from deployments.k8s.monitoring import render_monitors
from deployments.k8s.params import DEFAULT_PARAMS
from deployments.k8s.render import render_all

# ------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="k8s_command", required=True, metavar="ACTION")
    for name, text in (("render", "write k8s/<preset>.rayservice.yaml from configs/"),
                       ("check", "exit 1 if a committed manifest is stale")):
        sp = sub.add_parser(name, help=text, description=text)
        sp.add_argument("--params", type=Path, default=DEFAULT_PARAMS,
                        help="params file (default: k8s/params.yaml)")
        sp.add_argument("--out", type=Path, default=None,
                        help="manifest directory (default: the params file's directory)")
        sp.add_argument("--no-monitors", action="store_true",
                        help="leave out the PodMonitors (default: also <out>/monitoring/"
                             "<preset>.podmonitor.yaml, for the Prometheus operator)")
        if name == "render":
            sp.add_argument("--check", action="store_true",
                            help="do not write; exit 1 if a manifest is stale")


def main(args: argparse.Namespace) -> int:
    try:
        rendered = render_all(args.params)
        monitors = {} if args.no_monitors else render_monitors(args.params)
    except ConfigError as exc:
        print(f"dsv4-serve k8s: {exc}", file=sys.stderr)
        return 2
    out_dir = args.out or args.params.parent
    targets = [(out_dir, rendered)] + ([(out_dir / "monitoring", monitors)] if monitors else [])
    if args.k8s_command == "check" or getattr(args, "check", False):
        problems = [p for where, files in targets for p in stale_files(where, files)]
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("Fix: dsv4-serve k8s render", file=sys.stderr)
        return 1 if problems else 0
    for where, files in targets:
        where.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (where / name).write_text(text)
            print(where / name)
    return 0
