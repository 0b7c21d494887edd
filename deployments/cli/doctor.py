"""``dsv4-serve doctor``: the vLLM side (``dsv4_patch.doctor``) plus the Ray touches.

``dsv4_patch`` imports no Ray, so its doctor reports vLLM, the platform, the KV
layout and the vLLM patches; this adds every Ray internal ``deployments/`` relies
on (``deployments.ray_touches``), probed in the installed Ray. Exit status 1 when
the dtype is refused or a required Ray touch is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dsv4_patch import doctor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    doctor.add_arguments(parser)


def ray_touches() -> list[dict[str, Any]] | str:
    """The probed registry, or why Ray cannot be probed here (e.g. not installed)."""
    try:
        from deployments import ray_touches as touches

        return touches.probe_all()
    except ImportError as exc:
        return f"Ray is not importable ({exc}); install the [cpu] or [gpu] extra to serve"


def main(args: argparse.Namespace) -> int:
    data = doctor.report(args)
    data["ray_touches"] = ray_touches()
    rows = data["ray_touches"]
    if args.json:
        text = json.dumps(data, indent=2)
    elif isinstance(rows, str):
        text = doctor.render(data) + f"\nray touches: {rows}"
    else:
        from deployments.ray_touches import render

        text = "\n".join([doctor.render(data), *render(rows)])
    sys.stdout.write(text + "\n")
    missing = not isinstance(rows, str) and any(r["required"] and not r["present"] for r in rows)
    return 1 if "error" in data["resolution"] or missing else 0
