"""API key files (issue 26): parse first, then switch; a bad edit is loud and never a leak.

Real files in tmp dirs, the real ``KeyStore`` and the real edge (``harden`` on a
stand-in FastAPI app, raw ASGI calls: ``test_edge``'s harness). Each case failed
before the fix: the old store recorded the new mtime before parsing (a bad edit
kept the old keys until the file changed again, silently), compared mtimes only
(``cp -p`` went unseen), let a missing file open a loopback server, and its
exception reached callers through vLLM's catch-all handler.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from deployments.config import HTTPEdge
from deployments.http import auth
from deployments.http.auth import KeyFileStatus, KeyStore
from deployments.http.edge import Edge
from tests.support.edge_app import Probe, build, error, guard, post

GOOD = "g" * 24
NEW = "n" * 24
OTHER = "o" * 24


@pytest.fixture(autouse=True)
def fast_rechecks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Look at the file on every call; re-read unchanged stats after 0.2 s."""
    monkeypatch.setattr(auth, "FILE_RECHECK_S", 0.0)
    monkeypatch.setattr(auth, "FILE_REHASH_S", 0.2)


@pytest.fixture
def logged() -> Any:
    """The ERROR lines of ``dsv4_serve.auth`` (its family does not propagate to root)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign, assignment]  # capture
    logger = logging.getLogger("dsv4_serve.auth")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def store(path: Path, watched: list[KeyFileStatus] | None = None) -> KeyStore:
    keys = KeyStore(HTTPEdge().auth, {"DSV4_API_KEYS_FILE": str(path)})
    if watched is not None:
        keys.watch(watched.append)
    return keys


@pytest.mark.parametrize(("bad", "says"), [
    (b"short-key\n", "shorter than 16"),
    (f"{NEW}\n\xff{NEW}\n".encode("latin-1"), "not UTF-8"),
    (b"k" * (auth.MAX_KEY_FILE_BYTES + 1), "not a key file"),
])
def test_a_bad_edit_keeps_the_last_good_keys_and_says_so(tmp_path: Path, logged: Any,
                                                          bad: bytes, says: str) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{GOOD}\n")
    watched: list[KeyFileStatus] = []
    keys = store(path, watched)
    path.write_bytes(bad)
    assert keys.matches(GOOD), "a bad edit revoked the last good key"
    status = keys.file_status()
    assert status is not None and status.state == "stale" and status.keys == 1
    assert status.refused == 1 and says in str(status.problem)
    assert "problem" not in status.public() and str(path) not in str(status.public())
    assert watched[-1].state == "stale", "the watcher (metrics) was not told"
    [line] = [r.getMessage() for r in logged]
    assert "REFUSED" in line and says in line and str(path) in line
    for _ in range(3):  # once per bad content, not once per request
        keys.matches(GOOD)
    assert len(logged) == 1
    path.write_text(f"{NEW}\n")  # the fix: switched to at once
    assert keys.matches(NEW) and not keys.matches(GOOD)
    fixed = keys.file_status()
    assert fixed is not None and fixed.state == "ok" and fixed.refused == 1
    assert watched[-1].state == "ok"


def test_an_unreadable_file_keeps_the_last_good_keys(tmp_path: Path, logged: Any) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{GOOD}\n")
    keys = store(path)
    path.unlink()
    path.mkdir()  # reading a directory fails like an unreadable file (root reads 0o000)
    assert keys.matches(GOOD)
    status = keys.file_status()
    assert status is not None and status.state == "stale"
    assert "cannot be read" in str(status.problem) and len(logged) == 1


def test_a_copy_keeping_size_and_mtime_is_seen(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``cp -p``: same size, same mtime. Detected by re-hashing, even when the stat
    signature is fooled completely (a file system with coarse times)."""
    path = tmp_path / "keys"
    path.write_text(f"{GOOD}\n")
    before = path.stat()
    keys = store(path)
    monkeypatch.setattr(auth, "stat_signature", lambda _: (1, 2, 3))
    assert keys.matches(GOOD)
    path.write_text(f"{NEW}\n")  # same length
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size
    assert path.stat().st_mtime_ns == before.st_mtime_ns
    time.sleep(auth.FILE_REHASH_S + 0.05)
    assert keys.matches(NEW) and not keys.matches(GOOD)


def test_same_bytes_rewritten_are_no_change(tmp_path: Path, logged: Any) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{GOOD}\n")
    watched: list[KeyFileStatus] = []
    keys = store(path, watched)
    path.write_text(f"{GOOD}\n")
    time.sleep(auth.FILE_REHASH_S + 0.05)
    assert keys.matches(GOOD) and len(watched) == 1 and not logged


def test_a_bad_file_at_startup_refuses_to_start(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_bytes(b"\xfe\xff" + GOOD.encode())
    with pytest.raises(auth.AuthConfigError, match=r"DSV4_API_KEYS_FILE=.*not UTF-8.*Fix:"):
        store(path)


def test_a_deleted_file_revokes_and_fails_closed(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{GOOD}\n")
    keys = store(path)
    path.unlink()
    assert not keys.matches(GOOD)
    status = keys.file_status()
    assert status is not None and status.state == "missing" and status.keys == 0
    assert keys.required("127.0.0.1"), "a configured key file must never open the server"


def test_mode_off_refuses_a_configured_key_file(tmp_path: Path) -> None:
    with pytest.raises(auth.AuthConfigError, match="mode=off but 0 key"):
        Edge.start(HTTPEdge(auth={"mode": "off"}), "127.0.0.1",
                   environ={"DSV4_API_KEYS_FILE": str(tmp_path / "keys")})


def test_callers_never_see_the_key_file_or_its_fault(tmp_path: Path) -> None:
    """A bad edit: valid keys pass, others get a plain 401. A check that raises: 503
    with a request id; the path and the text stay in the log."""
    path = tmp_path / "secret-dir" / "keys"
    path.parent.mkdir()
    path.write_text(f"{GOOD}\n")
    probe = Probe()
    g = guard(HTTPEdge(), "0.0.0.0", DSV4_API_KEYS_FILE=str(path))
    app = build(HTTPEdge(), probe, g)
    path.write_text("short\n")
    assert post(app, {"prompt": "x"}, headers={"authorization": f"Bearer {GOOD}"})[0] == 200
    status, _, data = post(app, {"prompt": "x"}, headers={"authorization": f"Bearer {OTHER}"})
    assert status == 401 and b"secret-dir" not in data and b"shorter" not in data

    def broken(_: str) -> bool:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, f"in {path}")

    g.keys.matches = broken  # type: ignore[method-assign, assignment]  # a failing store
    status, hdrs, data = post(app, {"prompt": "x"}, headers={"authorization": f"Bearer {GOOD}",
                                                             "x-request-id": "req-9"})
    assert status == 503 and "retry-after" in hdrs, data
    assert b"secret-dir" not in data and b"utf-8" not in data
    assert "req-9" in error(data)["message"]


class _Series:
    """Records what the replica's metrics were given."""

    def __init__(self, name: str, description: str = "", **_: Any) -> None:
        self.name = name
        self.values: list[Any] = []
        SERIES[name] = self

    def set(self, value: float) -> None:
        self.values.append(value)

    def inc(self, value: float = 1.0) -> None:
        self.values.append(value)


SERIES: dict[str, _Series] = {}


def test_the_watcher_drives_the_replica_metrics(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``key_file_metrics`` (the replica's Prometheus series) follows every status."""
    from ray.serve import metrics

    from deployments.http import key_metrics

    monkeypatch.setattr(metrics, "Gauge", _Series)
    monkeypatch.setattr(metrics, "Counter", _Series)
    path = tmp_path / "keys"
    path.write_text(f"{GOOD}\n{NEW}\n")
    keys = store(path)
    keys.watch(key_metrics.key_file_metrics())
    path.write_text("short\n")
    assert keys.matches(GOOD)
    assert SERIES["dsv4_api_key_file_stale"].values == [0, 1]
    assert SERIES["dsv4_api_key_file_keys"].values == [2, 2]
    assert SERIES["dsv4_api_key_file_refused_edits_total"].values == [1]
    path.write_text(f"{NEW}\n")
    assert keys.matches(NEW)
    assert SERIES["dsv4_api_key_file_stale"].values[-1] == 0
    assert SERIES["dsv4_api_key_file_keys"].values[-1] == 1


def test_status_shows_a_stale_key_file_without_its_path(tmp_path: Path) -> None:
    """``GET /v1/kv-spec`` carries the answering replica's key file status (no path, no
    error text) and ``dsv4-serve status`` prints it loudly."""
    from deployments.cli.status import describe_ingress
    from deployments.http.front import kv_spec_response

    path = tmp_path / "secret-dir" / "keys"
    path.parent.mkdir()
    path.write_text(f"{GOOD}\n{NEW}\n")
    g = guard(HTTPEdge(), "0.0.0.0", DSV4_API_KEYS_FILE=str(path))
    path.write_text("short\n")
    response = kv_spec_response({"state": "not_checked"}, "cached", g.keys)
    text = bytes(response.body).decode()
    assert "secret-dir" not in text and "shorter" not in text
    body = json.loads(text)
    assert body["ingress"]["api_key_file"]["state"] == "stale"
    [line] = describe_ingress(body)
    assert "STALE" in line and "still serving the 2 key(s)" in line
    path.write_text(f"{NEW}\n")
    [line] = describe_ingress(json.loads(bytes(kv_spec_response(
        {"state": "agree"}, "cached", g.keys).body)))
    assert "ok, 1 key(s)" in line


def test_a_refused_first_edit_of_an_empty_file_fails_closed(tmp_path: Path) -> None:
    """A file saying ``none`` leaves a loopback server open; an edit that tried to add
    keys but was refused must not keep it open."""
    path = tmp_path / "keys"
    path.write_text(f"{auth.NO_KEYS}\n")
    keys = store(path)
    assert not keys.required("127.0.0.1")
    path.write_text("short\n")
    assert keys.required("127.0.0.1") and not keys.matches("short")


@pytest.mark.parametrize("edit", [b"", b"\n", b"# rotating\n"])
def test_a_read_that_yields_no_key_is_a_bad_edit(tmp_path: Path, logged: Any,
                                                  edit: bytes) -> None:
    """``cat > keys`` / ``echo k > keys`` empty the file first (issue 32): that read
    keeps the last good set and says so, unless the file says ``none`` on purpose."""
    path = tmp_path / "keys"
    path.write_text(f"{GOOD}\n")
    keys = store(path)
    path.write_bytes(edit)
    assert keys.required("127.0.0.1") and keys.matches(GOOD)
    status = keys.file_status()
    assert status is not None and status.state == "stale" and status.keys == 1
    assert any(str(path) in r.getMessage() and "no key" in r.getMessage() for r in logged)
    path.write_text(f"{auth.NO_KEYS}  # no keys on purpose\n")
    assert not keys.required("127.0.0.1") and not keys.matches(GOOD)


def test_an_empty_file_at_startup_fails_closed(tmp_path: Path) -> None:
    """No last good set: an empty file starts, every request needs a key nobody has."""
    path = tmp_path / "keys"
    path.write_text("")
    keys = store(path)
    assert keys.required("127.0.0.1") and not keys.matches("")
    path.write_text(f"{GOOD}\n")
    assert keys.matches(GOOD)


@pytest.mark.parametrize("half", [b"k\n", f"{NEW[:8]}".encode(), f"{NEW}\x01\n".encode(),
                                  "ключ-ключ-ключ-ключ\n".encode()])
def test_a_half_written_key_is_not_a_key(tmp_path: Path, half: bytes) -> None:
    """A key has a shape (``auth.KEY_SHAPE_TEXT``); the refusal says what it is."""
    path = tmp_path / "keys"
    path.write_text(f"{GOOD}\n")
    keys = store(path)
    path.write_bytes(half)
    assert keys.matches(GOOD)
    status = keys.file_status()
    assert status is not None and status.state == "stale"
    assert auth.KEY_SHAPE_TEXT in str(status.problem)
