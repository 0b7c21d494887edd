"""One ``GET /v1/kv-spec`` for the pollers that watch it while replicas die
(``deployments.harness.multinode_scenario``, tests/support/serve_client.py, test_run_cli.py).

Not every answer during a fault is a report: when a replica dies with a request in
flight, Ray Serve's proxy ends the request without a response and uvicorn answers a
plain-text ``500 Internal Server Error`` (it failed CI's node-loss test once, in
``resp.json()``). Pollers treat that, like a refused connection, as transient.
"""

from __future__ import annotations

from typing import Any

import httpx


class NotAReport(Exception):
    """An answer whose body is not JSON (what the proxy sends for a request lost in flight)."""


# What a poller may see while a replica or node is going away: retried, never the verdict.
TRANSIENT = (httpx.HTTPError, NotAReport)


def kv_report(url: str, refresh: bool = True, timeout: float = 120.0,
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """(status, report) from ``{url}/kv-spec``; ``NotAReport`` for a non-JSON body."""
    resp = httpx.get(f"{url}/kv-spec", params={"refresh": str(refresh).lower()},
                     timeout=timeout, headers=headers)
    try:
        body = resp.json()
    except ValueError:
        raise NotAReport(f"HTTP {resp.status_code}: {resp.text[:200]!r}") from None
    return resp.status_code, body
