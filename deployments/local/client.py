"""A small HTTP client for our own endpoints (the KV-spec verdict, a one-token request).

Standard library only, so ``dsv4-serve status`` needs neither Ray nor an HTTP library;
it sends the API key the environment holds (``deployments.http.auth.client_headers``).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any


def _body(status: int, raw: bytes) -> dict[str, Any]:
    """A response body as JSON; a non-JSON one as an OpenAI-style error naming it.

    Not every answer comes from our edge: when a replica dies with a request in
    flight, Ray Serve's proxy ends the request and uvicorn answers a plain-text
    ``500 Internal Server Error`` (seen in CI during node loss). That is an answer
    to report, not a crash of the client polling through it.
    """
    if not raw:
        return {}
    try:
        parsed = json.loads(raw)
    except ValueError:
        text = raw[:300].decode(errors="replace")
        return {"error": {"message": f"HTTP {status} with a non-JSON body: {text!r}",
                          "type": "non_json_response", "code": status}}
    return parsed if isinstance(parsed, dict) else {"body": parsed}


def http_json(url: str, method: str = "GET", body: dict[str, Any] | None = None,
              timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) for a request; HTTP errors are answers, not exceptions."""
    data = None if body is None else json.dumps(body).encode()
    from deployments.http.auth import client_headers

    req = urllib.request.Request(url, data=data, method=method,  # noqa: S310  # http URL of our own Serve app
                                 headers={"Content-Type": "application/json",
                                          **client_headers()})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310  # http URL of our own Serve app
            return resp.status, _body(resp.status, resp.read())
    except urllib.error.HTTPError as err:
        return err.code, _body(err.code, err.read())


def wait_for_verdict(url: str, timeout_s: float = 300.0) -> dict[str, Any]:
    """Poll ``/v1/kv-spec?refresh=true`` until the verdict is not ``incomplete``."""
    deadline = time.monotonic() + timeout_s
    report: dict[str, Any] = {}
    while time.monotonic() < deadline:
        _, report = http_json(f"{url}/kv-spec?refresh=true")
        if report.get("state") in ("agree", "disagree"):
            return report
        time.sleep(2)
    raise TimeoutError(f"no KV-spec verdict after {timeout_s}s; last report: {report}")


def first_token(url: str, model: str) -> float:
    """Seconds for one 1-token completion: proof that a token comes out."""
    started = time.monotonic()
    status, body = http_json(f"{url}/completions", "POST",
                             {"model": model, "prompt": "Hello", "max_tokens": 1},
                             timeout=300)
    if status != 200:
        raise RuntimeError(f"first request failed with HTTP {status}: {body}")
    return round(time.monotonic() - started, 2)
