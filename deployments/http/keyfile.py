"""Keys judged: what a key looks like, how a key file parses, its status, loopback, Bearer.

Pure functions and records for ``deployments.http.auth.KeyStore`` (which watches the
file and switches to a good edit). See that module for the rules.
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from deployments.config import ConfigError


class AuthConfigError(ConfigError):
    """The auth settings cannot be honoured; the message names the setting and the fix."""


MIN_KEY_CHARS = 16
# What a key looks like: printable ASCII, no separator (space, comma) or comment (#).
KEY_SHAPE = re.compile(r"[!-~]+")
KEY_SHAPE_TEXT = (f"at least {MIN_KEY_CHARS} printable ASCII characters without space, "
                  "comma or #")
# A key file whose one line is this holds no key on purpose (auto mode on loopback
# then serves without keys); any other read that yields no key is a bad edit.
NO_KEYS = "none"
# A key file is a handful of lines; anything this large is not one.
MAX_KEY_FILE_BYTES = 1 << 20


def parse_keys(text: str, where: str) -> tuple[str, ...]:
    """Keys from an env value or a file body; rejects keys too short to be secrets."""
    keys = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        keys += [k for k in line.replace(",", " ").split() if k]
    short = [k for k in keys if len(k) < MIN_KEY_CHARS]
    if short:
        raise AuthConfigError(
            f"{where}: {len(short)} key(s) shorter than {MIN_KEY_CHARS} characters; a key "
            "that short can be guessed (or is half written). A key is "
            f"{KEY_SHAPE_TEXT}. Fix: generate one with "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`.")
    odd = [k for k in keys if not KEY_SHAPE.fullmatch(k)]
    if odd:
        raise AuthConfigError(
            f"{where}: {len(odd)} key(s) with a character outside printable ASCII: not a "
            f"key (a half-written or binary file?). A key is {KEY_SHAPE_TEXT}. Fix: write "
            "`secrets.token_urlsafe(32)` keys, one per line.")
    return tuple(dict.fromkeys(keys))


def says_no_keys(raw: bytes) -> bool:
    """Whether a key file's only content (comments aside) is the word ``NO_KEYS``."""
    words = [w for line in raw.decode("utf-8", "replace").splitlines()
             for w in line.split("#", 1)[0].split()]
    return words == [NO_KEYS]


def parse_key_bytes(raw: bytes, where: str) -> tuple[str, ...]:
    """Keys from a key file's bytes: UTF-8 only, bounded, then ``parse_keys``."""
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise AuthConfigError(
            f"{where}: {len(raw)} bytes, above {MAX_KEY_FILE_BYTES}: not a key file. Fix: "
            "point it at a file with one key per line.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise AuthConfigError(
            f"{where}: byte {exc.start} (line {line}) is not UTF-8 ({exc.reason}). Fix: "
            "write the keys as plain ASCII, one per line (`token_urlsafe` keys are).") from exc
    return parse_keys(text, where)


KeyFileState = Literal["ok", "missing", "stale"]


@dataclass(frozen=True)
class KeyFileStatus:
    """What the edge knows about its key file: for logs, metrics and ``status``.

    ``stale`` means a bad edit is being ignored and the last good set still
    serves. ``problem`` names the file and the fault: operators only (log,
    ``dsv4-serve doctor``), never an HTTP caller (``public``).
    """

    state: KeyFileState
    keys: int  # keys from the file in use now
    loaded_at: float | None = None  # wall-clock time of the last good load
    failed_at: float | None = None  # wall-clock time of the refusal now in force
    refused: int = 0  # bad edits refused since this process started
    problem: str | None = None

    def public(self) -> dict[str, Any]:
        """The status without the file's path or the refusal's text."""
        data = asdict(self)
        data.pop("problem")
        return data


KeyFileWatcher = Callable[[KeyFileStatus], None]


def stat_signature(path: Path) -> tuple[int, ...] | None:
    """What a stat says about the file (None: missing); a change means re-read now."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError:
        return (-1,)  # unreadable metadata: the read that follows says why
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class FileState:
    path: Path
    signature: tuple[int, ...] | None = (-2,)  # never a real signature: the first look reads
    digest: bytes | None = b""  # SHA-256 of the bytes last judged (good or bad); None: missing
    checked: float = float("-inf")  # monotonic time of the last stat
    hashed: float = float("-inf")  # monotonic time of the last read
    keys: tuple[str, ...] = ()
    status: KeyFileStatus = KeyFileStatus("missing", 0)
    empty_read: bool = False  # the refusal in force is a read that yielded no key


def read_capped(path: Path) -> bytes:
    """The file's bytes, at most one byte over the limit (the parse refuses a larger one)."""
    with path.open("rb") as handle:
        return handle.read(MAX_KEY_FILE_BYTES + 1)


def when(wall: float | None) -> str:
    return "never" if wall is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


def is_loopback(host: str | None) -> bool:
    """True when ``host`` only accepts connections from this machine."""
    if host is None:
        return False
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to anything, treat it as reachable


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
