"""``dsv4-serve status [--json]``: the KV-spec consensus of a running app, over HTTP.

Reads ``GET /v1/kv-spec`` (the same port as the OpenAI API), so it works
against ``dsv4-serve run``, ``serve run`` or a KubeRay service alike, without
joining the Ray cluster. The answer is validated as the controller's own
``deployments.control.wire.FleetReport``. Exit code: 0 agree, 1 disagree, 3 incomplete,
not_checked, stale or unreachable: scripts can gate on it.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error

from pydantic import ValidationError

from deployments.control.report import describe
from deployments.control.wire import FleetReport
from deployments.local.client import http_json

EXIT = {"agree": 0, "disagree": 1}
EXIT_INCOMPLETE = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1",
                        help="OpenAI base URL of the app (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the raw report")
    parser.add_argument("--refresh", action="store_true",
                        help="ask every replica now instead of reading the last check")


def main(args: argparse.Namespace) -> int:
    url = f"{args.url.rstrip('/')}/kv-spec" + ("?refresh=true" if args.refresh else "")
    try:
        _, report = http_json(url, timeout=90)
    except (urllib.error.URLError, OSError) as exc:  # a non-JSON body is an answer
        print(f"dsv4-serve status: cannot read {url}: {exc}. Is the app running "
              "(`dsv4-serve run`) and is --url its OpenAI base URL?", file=sys.stderr)
        return EXIT_INCOMPLETE
    try:
        parsed = FleetReport.model_validate(report)
    except ValidationError as exc:
        print(f"dsv4-serve status: {url} answered something that is not a KV-spec report "
              f"({exc.errors(include_url=False)[0]['loc']}: "
              f"{exc.errors(include_url=False)[0]['msg']}): {str(report)[:300]}",
              file=sys.stderr)
        return EXIT_INCOMPLETE
    print(json.dumps(report, indent=2) if args.json else describe(parsed))
    return EXIT.get(parsed.state.value, EXIT_INCOMPLETE)
