"""The ``dsv4-serve`` command: a thin dispatcher over the modules that do the work.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``; modules are imported lazily so ``dsv4-serve doctor`` never
pays for Ray and ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("deployments.cli.doctor",
               "vLLM version, platform, KV layout, the patches and Ray touches that apply"),
    "tiny-model": ("dsv4_patch.tiny_model", "write the tiny random-weight DeepSeek-V4 directory"),
    "run": ("deployments.cli.run", "run the Serve app locally (default: configs/local-cpu.yaml)"),
    "status": ("deployments.cli.status", "print the KV-spec consensus of a running app"),
    "policy": ("deployments.cli.policy",
               "set (or clear) the KV-spec policy of every replica of a running app"),
    "plan": ("deployments.cli.plan", "preflight a config without GPUs: layout, bytes, capacity"),
    "k8s": ("deployments.cli.k8s", "render or check RayService manifests from configs/"),
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """Build the parser; only the chosen subcommand's module is imported."""
    parser = argparse.ArgumentParser(prog="dsv4-serve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sp)
            sp.set_defaults(_main=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return int(args._main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
