"""Put/get latency of the Responses store backends (``deployments.responses``).

``python -m benchmarks.responses_store [--n 1000]``: SQLite on a temp file and, when a
``redis-server`` is on PATH, Redis on 127.0.0.1 (started here, a free port); one
client, one call at a time, a ~4 KiB response. Prints p50/p99 per call in ms and writes
them as ``benchmarks/results/responses_store.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.results import this_command, write_result
from deployments.responses.redis_store import RedisStore
from deployments.responses.sqlite import SQLiteStore
from deployments.responses.store import Quota, owner_of

BODY = json.dumps({"id": "resp_x", "output": [{"text": "x" * 4000}]})


def _ms(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"p50 {statistics.median(ordered) * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms"


def rows_of(measured: dict[str, dict[str, str] | None]) -> list[list[str]]:
    """One row per backend and call: the printed p50 and p99 (ms)."""
    rows = []
    for backend, calls in measured.items():
        for call, text in (calls or {}).items():
            p50, p99 = (part.split()[1] for part in text.split(", "))
            rows.append([backend, call, p50, p99])
    return rows


def record(measured: dict[str, dict[str, str] | None], n: int) -> Path:
    """``benchmarks/results/responses_store.json``: a backend not run has no rows."""
    missing = [b for b, calls in measured.items() if calls is None]
    return write_result(
        "responses_store", title="Responses store: put/get latency by backend",
        what=("Put and get latency of the Responses store backends: SQLite on a temp file, "
              "Redis on 127.0.0.1 when a redis-server is on PATH; one client, one call at a "
              "time, a ~4 KiB response."),
        command=this_command("benchmarks.responses_store"), inputs={"n": n},
        columns=["backend", "call", "p50 ms", "p99 ms"], rows=rows_of(measured),
        notes=f"Not run (no server on PATH): {missing}." if missing else "")


async def _measure(store: Any, n: int) -> dict[str, str]:
    owner = owner_of("a" * 64)
    puts, gets = [], []
    for i in range(n):
        started = time.perf_counter()
        await store.put_response(owner, f"resp_{i}", BODY, "completed", keep_cancelled=True)
        puts.append(time.perf_counter() - started)
    for i in range(n):
        started = time.perf_counter()
        assert await store.get(owner, f"resp_{i}") is not None
        gets.append(time.perf_counter() - started)
    await store.close()
    return {"put": _ms(puts), "get": _ms(gets)}


def _redis(n: int) -> dict[str, str] | None:
    exe = shutil.which("redis-server") or shutil.which("valkey-server")
    if exe is None:
        return None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", ""],
                            stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        store = RedisStore(f"redis://127.0.0.1:{port}/0", None, "bench", Quota(3600, 10 * n), 2.0)
        return asyncio.run(_measure(store, n))
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=1000)
    n = parser.parse_args().n
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLiteStore(Path(tmp) / "r.sqlite3", Quota(3600, 10 * n), 2.0)
        sqlite = asyncio.run(_measure(store, n))
    print("sqlite:", sqlite)
    redis = _redis(n)
    print("redis:", redis or "no redis-server on PATH")
    print(f"wrote {record({'sqlite': sqlite, 'redis': redis}, n)}")


if __name__ == "__main__":
    main()
