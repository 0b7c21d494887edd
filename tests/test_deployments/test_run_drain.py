"""SIGTERM to ``dsv4-serve run`` while requests stream: they finish, then nothing is left.

``test_run_cli.py`` proves a clean stop of an idle stack; this proves the drain:
requests already streaming when SIGTERM arrives run to their last token (Serve
drains replicas before their vLLM engines stop), and afterwards no Ray or vLLM
process started by the run survives. One replica on port 8010 (Serve's proxy on
8011; its own private Ray cluster) keeps the boot short and never collides with the
session stack, which holds 8000 and 8500 from test_kv_controller.py on and idles
while this runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from deployments.config import DEFAULT_CONFIG
from deployments.harness.run_process import SERVING_LINE, descendants, read_until_serving
from tests.support.procs import alive

pytestmark = pytest.mark.slow

PORT = 8010
BOOT_TIMEOUT_S = 420
STOP_TIMEOUT_S = 120
STREAMS = 3
MAX_TOKENS = 48


def one_replica_config(tmp_path: Path) -> Path:
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["http_options"]["port"] = PORT + 1  # Serve's proxy
    raw["applications"][0]["args"]["http"]["replica_port"] = PORT  # the replicas' own door
    auto = raw["applications"][0]["args"]["llm"]["deployment_config"]["autoscaling_config"]
    auto["min_replicas"] = auto["max_replicas"] = 1
    path = tmp_path / "one-replica.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


class Stream(threading.Thread):
    """One streaming completion; records first-chunk time, tokens and finish reason."""

    def __init__(self, url: str, model: str):
        super().__init__(daemon=True)
        self.url, self.model = url, model
        self.first = threading.Event()
        self.chunks = 0
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.done_marker = False
        self.error: str | None = None

    def run(self) -> None:
        body = {"model": self.model, "prompt": "Drain", "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{self.url}/completions", json=body,
                              timeout=STOP_TIMEOUT_S) as resp:
                if resp.status_code != 200:
                    self.error = f"HTTP {resp.status_code}: {resp.read()[:300]!r}"
                    return
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        self.done_marker = True
                        break
                    chunk = json.loads(data)
                    if chunk.get("usage"):
                        self.usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        self.chunks += 1
                        self.finish = choice.get("finish_reason") or self.finish
                    self.first.set()
        except httpx.HTTPError as exc:  # asserted on by the test
            self.error = repr(exc)
        finally:
            self.first.set()


def test_sigterm_drains_streaming_requests_and_leaves_nothing(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("dsv4-serve")
    proc = subprocess.Popen([str(exe), "run", str(one_replica_config(tmp_path)), "--no-smoke"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    streams: list[Stream] = []
    try:
        out = read_until_serving(proc, BOOT_TIMEOUT_S)
        assert SERVING_LINE in out, out[-4000:]
        url = f"http://127.0.0.1:{PORT}/v1"
        streams = [Stream(url, "dsv4-tiny") for _ in range(STREAMS)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(120), "a stream never produced its first chunk"
        assert all(s.error is None for s in streams), [s.error for s in streams]
        in_flight = [s.chunks for s in streams]
        pids = descendants(proc.pid)
        sigterm_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for s in streams:
            s.join(STOP_TIMEOUT_S)
        drained_s = time.monotonic() - sigterm_at
        try:
            rest, _ = proc.communicate(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stopped_s = time.monotonic() - sigterm_at
    print(f"SIGTERM with {STREAMS} streams in flight (chunks so far {in_flight}): streams "
          f"done after {drained_s:.1f} s, dsv4-serve run exited after {stopped_s:.1f} s")
    for s in streams:
        assert s.error is None, s.error
        assert s.finish == "length" and s.done_marker, (s.finish, s.done_marker)
        assert s.usage is not None and s.usage["completion_tokens"] == MAX_TOKENS
    assert min(in_flight) < MAX_TOKENS, "streams finished before SIGTERM: nothing was drained"
    print(rest[-2000:])
    assert proc.returncode == 0, rest[-4000:]
    assert f"draining {STREAMS} in-flight request(s)" in rest, rest[-4000:]
    assert "drained in" in rest, rest[-4000:]
    assert len(pids) > 5, f"expected Ray + replica + engine processes, saw {pids}"
    deadline = time.monotonic() + 30
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(1)
    assert not alive(pids), f"left after dsv4-serve run stopped: {alive(pids)}"
