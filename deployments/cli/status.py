"""``dsv4-serve status [--json]``: the KV-spec consensus of a running app, over HTTP.

Reads ``GET /v1/kv-spec`` (the same port as the OpenAI API), so it works
against ``dsv4-serve run``, ``serve run`` or a KubeRay service alike, without
joining the Ray cluster. The answer is validated as the controller's own
``deployments.control.wire.FleetReport``. Exit code: 0 agree, 1 disagree, 3 incomplete,
not_checked, stale or unreachable: scripts can gate on it.

With ``--metrics URL`` (Ray's metrics agent) it also prints, per replica and node type,
KV use against ``plan``'s capacity, the TTFT split into the serving path's part and the
engine's, and refusals by reason (``deployments.observe.scrape``).

The answer also says how the answering replica's edge is (``ingress``): an API
key file whose last edit was refused (``stale``: the previous keys still serve)
is printed loudly; the replica's log has the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
from typing import Any

from pydantic import ValidationError

from deployments.control.report import describe
from deployments.control.wire import FleetReport
from deployments.local.client import http_json
from deployments.observe import scrape

EXIT = {"agree": 0, "disagree": 1}
EXIT_INCOMPLETE = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1",
                        help="OpenAI base URL of the app (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the raw report")
    parser.add_argument("--refresh", action="store_true",
                        help="ask every replica now instead of reading the last check")
    parser.add_argument("--metrics", metavar="URL", default=None,
                        help="also read this Prometheus endpoint (Ray's metrics agent; "
                        "`dsv4-serve run` prints it) for KV use, TTFT split and refusals "
                        "per replica and node type")


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
    text = describe(parsed)
    text = "\n".join([text, *describe_ingress(report), *describe_metrics(args.metrics, parsed)])
    print(json.dumps(report, indent=2) if args.json else text)
    return EXIT.get(parsed.state.value, EXIT_INCOMPLETE)


def describe_metrics(url: str | None, report: FleetReport) -> list[str]:
    """The scrape's figures per replica and node type (``deployments.observe.scrape``)."""
    if url is None:
        return []
    try:
        text = scrape.read(url)
    except (urllib.error.URLError, OSError) as exc:
        return [f"  metrics: cannot read {url}: {exc}. Fix: pass Ray's metrics agent "
                "address (`dsv4-serve run` prints it; on Kubernetes a node's :8080)."]
    return scrape.describe(scrape.per_replica(scrape.samples(text), report.deployment,
                                                   report.application))


def describe_ingress(report: Any) -> list[str]:
    """The answering replica's API key file status (``deployments.http.front.ingress_state``)."""
    ingress = report.get("ingress") if isinstance(report, dict) else None
    state = (ingress or {}).get("api_key_file")
    if not isinstance(state, dict):
        return []
    if state.get("state") == "stale":
        return [f"  API key file (answering replica): STALE: an edit was refused at "
                f"{_when(state.get('failed_at'))} ({state.get('refused')} refused so far); "
                f"still serving the {state.get('keys')} key(s) loaded at "
                f"{_when(state.get('loaded_at'))}. Fix: correct the file; the replica's log "
                "says what was wrong."]
    if state.get("state") == "missing":
        return ["  API key file (answering replica): MISSING: no key from it is valid "
                "(requests fail closed with 401)."]
    return [f"  API key file (answering replica): ok, {state.get('keys')} key(s) loaded at "
            f"{_when(state.get('loaded_at'))}"]


def _when(wall: Any) -> str:
    if not isinstance(wall, (int, float)):
        return "never"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))
