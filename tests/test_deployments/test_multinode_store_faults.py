"""The fleet store killed mid-conversation on a local 2-node cluster (issue 52).

``dsv4-serve run --nodes 2`` (the multi-node harness, behind HAProxy with a key), the
Responses store on a real redis-server (append-only, fsync always, as a fleet's would
be): a conversation of stored turns, Redis SIGKILLed between two turns, the next turn
a 503 naming the store with nothing stored (the server's key count is unchanged once it
is back), and the follow-up on the last good turn answered again after the restart.
One more cluster with an engine: ``make test-faults`` (``DSV4_FULL_FAULTS=1``) runs it.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from deployments import serve_env
from deployments.harness import multinode_scenario as mn
from tests.support import redis_server

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not mn.FULL_FAULTS, reason="one more cluster with an engine: "
                                 "`make test-faults` (DSV4_FULL_FAULTS=1) runs it")]

MODEL = "dsv4-tiny"
PREFIX = "dsv4:faults"


class AofRedis:
    """redis-server with an append-only file: SIGKILLed, it comes back with what it
    acknowledged (on the same port)."""

    def __init__(self, exe: str, workdir: Path) -> None:
        self.exe, self.workdir, self.port = exe, workdir, redis_server.free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "yes", "--appendfsync", "always",
             "--requirepass", redis_server.PASSWORD, "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                time.sleep(0.2)  # the AOF is loaded before commands are served
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{self.exe} did not listen on 127.0.0.1:{self.port} in 10 s")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def contents(self) -> dict[str, Any]:
        """Every key under the store's prefix with its fields/members (what was written)."""
        import redis

        client = redis.Redis(port=self.port, password=redis_server.PASSWORD)
        try:
            found: dict[str, Any] = {}
            for key in client.scan_iter(match=f"{PREFIX}*", count=1000):
                kind = client.type(key)
                found[key.decode()] = (sorted(client.hkeys(key)) if kind == b"hash" else
                                       client.zrange(key, 0, -1) if kind == b"zset" else
                                       client.get(key) if kind == b"string" else kind)
            return found
        finally:
            client.close()


def _config(tmp: Path, port: int) -> Path:
    path = mn.autoscaling_config_file(tmp, max_replicas=1)
    raw = yaml.safe_load(path.read_text())
    raw["applications"][0]["args"]["responses"] = {
        "backend": "redis", "url": f"redis://127.0.0.1:{port}/0", "key_prefix": PREFIX,
        "timeout_s": 1.0}
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[mn.Run, AofRedis]]:
    exe = redis_server.binary()
    if exe is None:
        pytest.skip("no redis-server (make setup installs it)")
    tmp = tmp_path_factory.mktemp("store-faults")
    server = AofRedis(exe, tmp)
    server.start()
    env = mn.STORY_ENV | {"DSV4_RESPONSES_STORE_PASSWORD": redis_server.PASSWORD}
    started = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        for name in serve_env.LOCAL_QUIET_ENV:
            patch.delenv(name, raising=False)
        run = mn.start_run(_config(tmp, server.port), 2, 5.0, env=env)
    print(f"boot (2 nodes, Redis store): {time.monotonic() - started:.1f} s")
    try:
        yield run, server
    finally:
        mn.kill_leftovers(run)
        server.kill()


def _turn(client: httpx.Client, text: str, previous: str | None) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "input": text, "max_output_tokens": 4,
                            "store": True}
    if previous is not None:
        body["previous_response_id"] = previous
    return client.post("/responses", json=body)


def test_redis_killed_mid_conversation_then_back(stack: tuple[mn.Run, AofRedis]) -> None:
    run, server = stack
    with httpx.Client(base_url=mn.URL, headers=mn.AUTH, timeout=120) as client:
        ids: list[str] = []
        for text in ("one", "two"):
            resp = _turn(client, text, ids[-1] if ids else None)
            assert resp.status_code == 200, resp.text
            ids.append(resp.json()["id"])
        stored = server.contents()
        assert stored, "the conversation stored nothing in Redis"
        server.kill()
        killed = time.monotonic()
        for previous in (ids[-1], None):  # a follow-up and a new conversation
            down = _turn(client, "three", previous)
            assert down.status_code == 503, down.text
            message = down.json()["error"]["message"]
            assert "Redis Responses store" in message, message
        took = time.monotonic() - killed
        server.start()
        assert server.contents() == stored, "a turn answered 503 left something behind"
        again, deadline = None, time.monotonic() + 30
        while time.monotonic() < deadline:  # the store's client reconnects
            again = _turn(client, "three", ids[-1])
            if again.status_code == 200:
                break
            time.sleep(1)
        assert again is not None and again.status_code == 200, again.text if again else None
        back = time.monotonic() - killed - took
        follow = client.get(f"/responses/{again.json()['id']}")
        assert follow.status_code == 200, follow.text
        assert client.get(f"/responses/{ids[0]}").status_code == 200
    print(f"2 answered 503 in {took:.1f} s with Redis down; first turn served "
          f"{back:.1f} s after the restart; {len(stored)} Redis keys before the kill")
    code, _, stop_s = mn.stop_run(run)
    assert code == 0
    print(f"stop: {stop_s:.1f} s")
