"""Benchmark: what a streamed token costs each serving process at the rates a GPU node makes.

Why (issue 34): on one 8-GPU node a DeepSeek-V4 replica streams ~20k tokens/s (8 ranks
x ~2,500 tok/s, sglang#33109); the CPU each token costs in the HTTP path decides how
many cores the node needs for serving alone. A CPU machine cannot produce tokens that
fast, so stand-in replicas do: a FastAPI app whose ``POST /v1/chat/completions``
streams OpenAI-shaped SSE chunks (``k`` tokens each) at a paced rate, with no engine.

Arms, each its own session of processes (``benchmarks.arm_procs``):

* ``port``: the stand-in app on the replicas' own port (``deployments.doors.listener``:
  uvicorn with the port's bounds and held-request tracking), one process.
* ``proxy``: the same app as a Serve deployment (``serve.ingress``) behind Serve's HTTP
  proxy on a private local Ray: client -> proxy actor -> replica actor.
* ``haproxy``: the same deployment behind the door the KubeRay presets ship
  (``http.ingress: haproxy``): Ray's HAProxy, run as ``dsv4-haproxy``, forwarding to the
  replica's own port on its app loop (``deployments.doors.haproxy_target``):
  client -> HAProxy -> replica actor.
* ``haproxy-ray``: the same with ``DSV4_HAPROXY_TARGET=ray``: HAProxy forwards to Ray's
  direct-ingress server on Serve's loop, which hands each chunk across threads.
* ``port-edge``: the ``port`` arm with the stand-in behind our real edge
  (``front.harden``: keys, bounds, routes, stream limits, scrub), as the replicas serve
  vLLM's app. (A ``proxy-edge`` arm needs the app built in the replica through
  ``__serve_build_asgi_app__``; a plain ``serve.ingress()`` class did not come up that
  way here, so it is left for the full matrix.) vLLM's own per-token work (detokenizing,
  its pydantic chunks) is in no arm: these are the costs of the path around it.

For each concurrency ``c`` and tokens per chunk ``k``, the node's rate is split over
the ``c`` streams; for ``--window`` seconds the client (this process, outside the
arms' sessions) keeps ``c`` streams open and counts the tokens that arrive; each arm
process's CPU over the window divided by the tokens is its CPU-ms per streamed token.
``cores/node`` = that x the node's token rate. The machine's cores are shared, so the
numbers are indicative; the achieved rate says whether the path kept up.

Heavy: ``flock /tmp/dsv4-heavy.lock timeout 300 python -m benchmarks.gpu_rate_sim``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from benchmarks.arm_procs import role_of, session_processes
from benchmarks.results import write_result
from deployments.local import ray_token

ARMS = ("port", "port-edge", "proxy", "haproxy", "haproxy-ray")


def standin_app(edge: bool = False) -> Any:
    """The stand-in replica: OpenAI-shaped SSE chunks at the rate the query asks; with
    ``edge``, behind our edge as the replicas serve vLLM's app (loopback: no key)."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        tokens = int(body["max_tokens"])
        rate, chunk = float(request.query_params["rate"]), int(request.query_params["chunk"])
        return StreamingResponse(stream(tokens, rate, chunk), media_type="text/event-stream")

    if not edge:
        return app
    from deployments.config.http import HTTPEdge
    from deployments.http import front
    from deployments.http.edge import Edge

    return front.harden(app, Edge.start(HTTPEdge(max_tokens=1 << 20), "127.0.0.1", environ={}))


async def stream(tokens: int, rate: float, chunk: int) -> Any:
    """``tokens`` in chunks of ``chunk``, paced to ``rate`` tokens/s (bursts when behind)."""
    loop = asyncio.get_running_loop()
    start, sent = loop.time(), 0
    while sent < tokens:
        due = (loop.time() - start) * rate
        if sent >= due:
            await asyncio.sleep((sent - due) / rate + chunk / rate)
        k = min(chunk, tokens - sent)
        delta = json.dumps({"id": "chatcmpl-sim", "object": "chat.completion.chunk",
                            "model": "sim", "choices": [{"index": 0, "delta": {
                                "content": " tok" * k}, "finish_reason": None}]})
        yield f"data: {delta}\n\n"
        sent += k
    yield "data: [DONE]\n\n"


# ------------------------------------------------------------------ arm servers


def serve_port_arm(port: int, edge: bool) -> None:
    """The ``port`` arm's one process: the app on a replica port, until SIGTERM."""
    from deployments.doors.listener import ReplicaListener

    async def run() -> None:
        listener = ReplicaListener(standin_app(edge), "127.0.0.1", port)
        await listener.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await listener.stop(1.0)

    asyncio.run(run())


def serve_proxy_arm(port: int, edge: bool, haproxy: str | None = None) -> None:
    """The ``proxy`` arm: Ray + Serve's HTTP proxy + one replica of the app, until SIGTERM;
    with ``haproxy`` (a ``DSV4_HAPROXY_TARGET``), Ray's HAProxy is the door (its side
    ports next to ``port``)."""
    from deployments import serve_env

    if haproxy:  # before Ray starts: every Ray process reads the flags at import
        os.environ[serve_env.HAPROXY_TARGET_FLAG] = haproxy
        serve_env.apply_ingress("haproxy")
        os.environ.update(serve_env.haproxy_ports_beside(port, replicas=2))
    import ray
    from ray import serve

    # address="local": a private cluster, never one another process started on this machine
    ray_token.use_private_token()  # else Ray writes ~/.ray/auth_token 0644
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})

    # Built here, once: FastAPI resolves the routes' annotations in this process (a copy
    # built in the replica from this __main__ module would not find ``Request``).
    app = standin_app(edge)

    @serve.deployment(name="GpuRateReplica", max_ongoing_requests=1024)
    @serve.ingress(app)
    class GpuRateReplica:
        async def __init__(self) -> None:  # type: ignore[misc]  # Serve awaits an async __init__
            # As a DSv4 replica does behind HAProxy: the app on its own port too.
            if haproxy and serve_env.haproxy_target() == "replica":
                from deployments.config.http import ReplicaPortLimits
                from deployments.doors import haproxy_target

                self._own = asyncio.get_running_loop().create_task(
                    haproxy_target.open_port(app, ReplicaPortLimits(), 5.0))

    # serve.deployment makes the class a Deployment; mypy reads Ray as Any, so sees the class.
    serve.run(GpuRateReplica.bind(), name="sim", route_prefix="/")  # type: ignore[attr-defined]  # serve.deployment makes the class a Deployment
    print("ready", flush=True)
    signal.sigwait({signal.SIGTERM})
    serve.shutdown()
    ray.shutdown()


def start_arm(arm: str, port: int) -> subprocess.Popen[bytes]:
    """The arm's server in its own session (its processes are then ``session_processes``)."""
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.gpu_rate_sim", "--serve-arm", arm,
         "--port", str(port)], start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if asyncio.run(one_stream_tokens(port, 4, 1000.0, 1)) == 4:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the arm on port {port} did not answer within {timeout_s:.0f} s")


# ------------------------------------------------------------------ the client


async def one_stream_tokens(port: int, tokens: int, rate: float, chunk: int) -> int:
    """One streamed request on its own connection; the tokens that arrived."""
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": tokens, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST /v1/chat/completions?rate={rate}&chunk={chunk} HTTP/1.1\r\n"
                 "host: sim\r\n".encode() +
                 b"content-type: application/json\r\nconnection: close\r\n"
                 b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = 0
    try:
        while line := await reader.readline():
            if line.startswith(b"data: {"):
                got += line.count(b" tok")
    finally:
        writer.close()
    return got


async def drive(port: int, streams: int, rate: float, chunk: int,
                window_s: float) -> int:
    """``streams`` streams kept open for ``window_s``; tokens received in the window."""
    per_stream = rate / streams
    tokens = max(chunk, int(per_stream * 2.0))  # a request lasts ~2 s at its rate
    stop_at = time.monotonic() + window_s
    total = 0

    async def worker() -> None:
        nonlocal total
        while time.monotonic() < stop_at:
            got = await one_stream_tokens(port, tokens, per_stream, chunk)
            total += got

    await asyncio.gather(*(worker() for _ in range(streams)))
    return total


def cpu_by_proc(root: int) -> dict[int, tuple[str, float]]:
    out = {}
    for proc in session_processes(root):
        try:
            t = proc.cpu_times()
            out[proc.pid] = (role(proc), t.user + t.system)
        except psutil.NoSuchProcess:
            continue
    return out


def role(proc: psutil.Process) -> str:
    """``arm_procs.role_of``, with the stand-in replica (either arm) named "replica"."""
    try:
        text = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    if "ServeReplica" in text or "--serve-arm port" in text:
        return "replica"
    return role_of(proc)


def measure(root: int, port: int, streams: int, rate: float, chunk: int,
            window_s: float) -> dict[str, Any]:
    before, client_before = cpu_by_proc(root), time.process_time()
    started = time.monotonic()
    tokens = asyncio.run(drive(port, streams, rate, chunk, window_s))
    elapsed = time.monotonic() - started
    after, client_cpu = cpu_by_proc(root), time.process_time() - client_before
    by_role: dict[str, float] = defaultdict(float)
    for pid, (name, cpu) in after.items():
        by_role[name] += cpu - before.get(pid, (name, 0.0))[1]
    per_token = {name: round(1000 * cpu / max(tokens, 1), 4) for name, cpu in by_role.items()
                 if cpu > 0.005}
    return {"streams": streams, "chunk": chunk, "target_tok_s": rate,
            "achieved_tok_s": round(tokens / elapsed), "tokens": tokens,
            "elapsed_s": round(elapsed, 2),
            "cpu_ms_per_token": per_token,
            "path_cpu_ms_per_token": round(sum(per_token.values()), 4),
            "client_cpu_ms_per_token": round(1000 * client_cpu / max(tokens, 1), 4)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_arm(arm: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    port = free_port()
    proc = start_arm(arm, port)
    try:
        wait_ready(port, 30.0 if arm.startswith("port") else 120.0)
        rows = []
        for streams in args.streams:
            for chunk in args.chunks:
                row = measure(proc.pid, port, streams, args.ranks * args.rank_tok_s, chunk,
                              args.window)
                row["arm"] = arm
                row["cores_per_node"] = round(row["path_cpu_ms_per_token"] *
                                              args.ranks * args.rank_tok_s / 1000, 2)
                print(json.dumps(row), flush=True)
                rows.append(row)
        return rows
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


COLUMNS = ["arm", "streams", "tok/chunk", "target tok/s", "achieved tok/s",
           "CPU-ms/token by process", "path CPU-ms/token", "÷ port",
           "cores for the node's rate"]


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """One row per arm and cell; "÷ port" = the arm's path over the ``port``
    arm's in the same cell: one uvicorn process, what vLLM's own API server is around
    its per-token work. That work (detokenizing, its pydantic chunks) is the same in
    every path, so a real path's ratio to vLLM's API server is at most this one."""
    port = {(r["streams"], r["chunk"]): r["path_cpu_ms_per_token"] for r in rows
            if r["arm"] == "port"}
    out = []
    for r in rows:
        procs = ", ".join(f"{k} {v}" for k, v in sorted(r["cpu_ms_per_token"].items()))
        base = port.get((r["streams"], r["chunk"]))
        versus = f"{r['path_cpu_ms_per_token'] / base:.2f}" if base else "-"
        out.append([str(r["arm"]), str(r["streams"]), str(r["chunk"]),
                    f"{r['target_tok_s']:.0f}", str(r["achieved_tok_s"]), procs,
                    str(r["path_cpu_ms_per_token"]), versus, str(r["cores_per_node"])])
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown of ``table_rows``."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(rows)]
    return "\n".join(lines)


def write_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> Path:
    """``benchmarks/results/gpu_rate_sim_s2j_1.json``: the run's table as data."""
    return write_result(
        "gpu_rate_sim_s2j_1", title="2j. The cost of a token at GPU rates (simulation) "
        "(table 1)",
        what=("What a streamed token costs each serving process at the rates a GPU node "
              "makes: stand-in replicas stream OpenAI-shaped SSE chunks at "
              f"{args.rank_tok_s:g} tok/s per rank x {args.ranks} ranks (no engine), "
              f"{args.window:g} s per cell; CPU-ms per token by process and for the path."),
        command=("flock /tmp/dsv4-heavy.lock timeout 900 python -m benchmarks.gpu_rate_sim "
                 f"--arms {' '.join(args.arms)}"),
        inputs={"arms": args.arms, "streams": args.streams, "chunks": args.chunks,
                "ranks": args.ranks, "rank_tok_s": args.rank_tok_s, "window_s": args.window},
        columns=COLUMNS, rows=[list(row) for row in table_rows(rows)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--chunks", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rank-tok-s", type=float, default=2500.0)
    parser.add_argument("--window", type=float, default=5.0, help="seconds per cell")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--serve-arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_arm:
        edge = args.serve_arm.endswith("-edge")
        if args.serve_arm.startswith("port"):
            serve_port_arm(args.port, edge)
        else:
            target = {"haproxy": "replica", "haproxy-ray": "ray"}.get(args.serve_arm)
            serve_proxy_arm(args.port, edge, haproxy=target)
        return 0
    rows = [row for arm in args.arms for row in run_arm(arm, args)]
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    print(table(rows))
    print(f"wrote {write_table(args, rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
