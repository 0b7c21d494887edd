"""``dsv4-serve k8s render|check``: write the manifests, or check the committed ones."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deployments.config import (
    ConfigError,
)
from deployments.k8s.lint import stale_files
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
        if name == "render":
            sp.add_argument("--check", action="store_true",
                            help="do not write; exit 1 if a manifest is stale")


def main(args: argparse.Namespace) -> int:
    try:
        rendered = render_all(args.params)
    except ConfigError as exc:
        print(f"dsv4-serve k8s: {exc}", file=sys.stderr)
        return 2
    out_dir = args.out or args.params.parent
    if args.k8s_command == "check" or getattr(args, "check", False):
        problems = stale_files(out_dir, rendered)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("Fix: dsv4-serve k8s render", file=sys.stderr)
        return 1 if problems else 0
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in rendered.items():
        (out_dir / name).write_text(text)
        print(out_dir / name)
    return 0
