"""The serving tests as clients of a running app: agreement, traffic, the response contract.

``wait_agree`` polls ``/v1/kv-spec`` until the controller agrees over N replicas;
``Traffic`` keeps client threads sending completions while a test breaks something;
``check`` is the contract every answer to any request body keeps (never a 5xx; a 4xx
carries an OpenAI-style error; a stream ends with ``[DONE]``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import httpx

from deployments.harness.kv_poll import TRANSIENT, kv_report

REQUEST_TIMEOUT_S = 120.0
HEAL_TIMEOUT_S = 300.0


def report(url: str, refresh: bool = True) -> tuple[int, dict[str, Any]]:
    return kv_report(url, refresh, REQUEST_TIMEOUT_S)


def wait_agree(url: str, replicas: int, exclude: AbstractSet[str] = frozenset(),
               timeout_s: float = HEAL_TIMEOUT_S) -> dict[str, Any]:
    """Until the controller reports agree over ``replicas`` ids, none of them in ``exclude``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            status, body = report(url)
            last = (status, body.get("state"), body.get("problems"))
            ids = {r["id"] for r in body.get("replicas", [])}
            if (status == 200 and body["answered"] == body["running_replicas"] == replicas
                    and not ids & exclude):
                return body
        except TRANSIENT as exc:  # the ingress answers again shortly: keep polling
            last = repr(exc)
        time.sleep(2)
    raise AssertionError(f"no agreement over {replicas} replicas in {timeout_s}s; last {last}")


@dataclass
class Outcome:
    started: float
    ended: float
    status: int | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass
class Traffic:
    """``threads`` clients sending short completions back to back until stopped."""

    url: str
    model: str
    threads: int = 4
    headers: dict[str, str] = field(default_factory=dict)  # the API key, where one is asked
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: list[threading.Thread] = field(default_factory=list)

    def _loop(self) -> None:
        body = {"model": self.model, "prompt": "Reliability", "max_tokens": 8,
                "temperature": 0.0}
        with httpx.Client(timeout=REQUEST_TIMEOUT_S, headers=self.headers) as http:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    resp = http.post(f"{self.url}/completions", json=body)
                    out = Outcome(t0, time.monotonic(), resp.status_code,
                                  None if resp.status_code == 200 else resp.text[:300])
                except httpx.HTTPError as exc:  # recorded and asserted on, not swallowed
                    out = Outcome(t0, time.monotonic(), None, repr(exc))
                with self._lock:
                    self.outcomes.append(out)

    def __enter__(self) -> Traffic:
        for _ in range(self.threads):
            worker = threading.Thread(target=self._loop, daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout=REQUEST_TIMEOUT_S + 10)
        assert not any(w.is_alive() for w in self._workers), "a client thread hung"

    def wait_for(self, count: int, timeout_s: float = 120.0) -> None:
        """Until ``count`` more requests finished (traffic really flows)."""
        target = len(self.outcomes) + count
        deadline = time.monotonic() + timeout_s
        while len(self.outcomes) < target:
            assert time.monotonic() < deadline, f"traffic stalled at {len(self.outcomes)}"
            time.sleep(0.1)


def check(resp: httpx.Response, sent: Any) -> None:
    assert resp.status_code < 500, f"{resp.status_code} for {sent!r}: {resp.text[:500]}"
    if resp.status_code >= 400:
        payload = resp.json()
        error = payload.get("error", payload)
        assert isinstance(error, dict) and isinstance(error.get("message"), str), payload
        return
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", resp.text[-500:]
        for event in events[:-1]:
            chunk = json.loads(event)
            if "error" in chunk:  # an error inside a 200 stream: must be a client error
                assert int(chunk["error"].get("code", 400)) < 500, chunk
        return
    payload = resp.json()
    assert "choices" in payload, payload
