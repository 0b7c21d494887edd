"""API keys for the HTTP edge: where they come from, how they are compared, when to refuse.

Keys never live in the Serve YAML (a config is committed, rendered into KubeRay
manifests and shown by ``serve status``/the dashboard). They come from the
process environment of the ingress replica:

* ``DSV4_API_KEYS``: one or more keys separated by commas or whitespace;
* ``DSV4_API_KEYS_FILE`` (or ``http.auth.keys_file``): a file with one key per
  line (``#`` comments allowed). A Kubernetes Secret mounted as a volume is such a
  file; the kubelet swaps it when the Secret changes, so a key rotates without a
  restart. The file is looked at (a ``stat``) at most once a second and re-read
  when its size, times or inode changed, and re-read anyway every
  ``FILE_REHASH_S``: a copy that keeps size and mtime (``cp -p``) is still seen.
  A change is decided by the SHA-256 of the bytes, never by the mtime alone.
  A read that yields no key is an edit in progress (``cat > keys`` and ``echo k >
  keys`` truncate first), refused like any bad edit, unless the file says so on
  purpose: its one line is ``none`` (``NO_KEYS``). A missing file holds no key and
  fails closed (below).

A key is at least ``MIN_KEY_CHARS`` printable ASCII characters without space, comma
or ``#`` (``KEY_SHAPE``): anything else in a key file (a half-written key, a binary
byte) is not a key, and the edit is refused.

A key file edit is **parsed first and switched to only when it is good**. A bad
edit (no key at all, a key shorter than ``MIN_KEY_CHARS`` or of another shape, a byte
that is not UTF-8, a file that cannot be read or is larger than
``MAX_KEY_FILE_BYTES``) keeps the last good set serving, and says so: an ERROR log
line naming the file and the fix, the ``KeyFileStatus`` the edge shows in
``GET /v1/kv-spec`` (``dsv4-serve status``) and the watcher the serving replica
turns into metrics. The text of a refusal (it names the file) goes to the log and
to operators, never to an HTTP caller. At startup there is no last good set: a bad
file refuses to start, and a file with no key (not ``none``) starts failing closed
(401 until it holds keys).

Several keys are valid at once: that is how a key rotates (add the new one, move
clients, remove the old one). Comparison is constant-time per key
(``hmac.compare_digest``) and every configured key is compared, so the time taken
does not say which key, or how much of one, matched.

Whether a key is needed at all (``http.auth.mode``): ``keys`` always; ``off``
never (and then no key may be configured, so nobody believes one protects them);
``auto`` (the default) needs one beyond a loopback address, and on a loopback
address as soon as one is configured; so ``make run`` on 127.0.0.1 works for a
new user without a key while nothing that answers beyond this machine answers
without one (the ingress refuses to start instead). In ``auto`` mode on loopback
a key file that says ``none`` leaves the server open, as if no key were configured
(the file may gain its first key while serving; writing ``none`` reopens the loopback
server); an empty key file, a configured key file that is **missing** (or whose edit
was refused while it held no key) fails closed: a key nobody has is required,
every request gets 401, until the file exists and holds keys. A missing file is
never read as "no keys wanted".
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from deployments import serve_env
from deployments.config import AuthConfig, ConfigError, ServeConfig
from deployments.logs import get_logger

logger = get_logger("auth")

MIN_KEY_CHARS = 16
# What a key looks like: printable ASCII, no separator (space, comma) or comment (#).
KEY_SHAPE = re.compile(r"[!-~]+")
KEY_SHAPE_TEXT = (f"at least {MIN_KEY_CHARS} printable ASCII characters without space, "
                  "comma or #")
# A key file whose one line is this holds no key on purpose (auto mode on loopback
# then serves without keys); any other read that yields no key is a bad edit.
NO_KEYS = "none"
# How often the key file is looked at (a stat, not a read).
FILE_RECHECK_S = 1.0
# How often it is re-read and hashed even when the stat looks unchanged: a copy
# that keeps size and mtime (``cp -p``), or a file system with coarse timestamps.
FILE_REHASH_S = 10.0
# A key file is a handful of lines; anything this large is not one.
MAX_KEY_FILE_BYTES = 1 << 20


class AuthConfigError(ConfigError):
    """The auth settings cannot be honoured; the message names the setting and the fix."""


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


def _stat_signature(path: Path) -> tuple[int, ...] | None:
    """What a stat says about the file (None: missing); a change means re-read now."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError:
        return (-1,)  # unreadable metadata: the read that follows says why
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class _FileState:
    path: Path
    signature: tuple[int, ...] | None = (-2,)  # never a real signature: the first look reads
    digest: bytes | None = b""  # SHA-256 of the bytes last judged (good or bad); None: missing
    checked: float = float("-inf")  # monotonic time of the last stat
    hashed: float = float("-inf")  # monotonic time of the last read
    keys: tuple[str, ...] = ()
    status: KeyFileStatus = KeyFileStatus("missing", 0)
    empty_read: bool = False  # the refusal in force is a read that yielded no key


class KeyStore:
    """The valid keys of this process: env keys plus the (re-read) key file."""

    def __init__(self, config: AuthConfig, environ: dict[str, str] | None = None,
                 watcher: KeyFileWatcher | None = None):
        env = os.environ if environ is None else environ
        self.mode = config.mode
        self._env_name = config.keys_env
        self._env_keys = parse_keys(env.get(config.keys_env, ""), f"${config.keys_env}")
        path = config.keys_file or env.get(config.keys_file_env) or None
        self._file = _FileState(Path(path)) if path else None
        self._file_where = (f"http.auth.keys_file={path!r}" if config.keys_file
                            else f"${config.keys_file_env}={path!r}")
        self._lock = threading.Lock()
        self._watcher = watcher
        if self._file is not None:
            self._reload(force=True)
            stale = self._file.status.state == "stale"
            if stale and not self._file.empty_read:  # no last good set to keep serving
                raise AuthConfigError(str(self._file.status.problem))

    @property
    def sources(self) -> list[str]:
        """Where keys come from, for logs and errors (never the keys)."""
        found = []
        if self._env_keys:
            found.append(f"{len(self._env_keys)} key(s) from the environment")
        if self._file is not None:
            found.append(f"{len(self._file.keys)} key(s) from {self._file.path}")
        return found

    @property
    def file_configured(self) -> bool:
        """Whether a key file is configured (it may be missing or empty now)."""
        return self._file is not None

    def file_status(self) -> KeyFileStatus | None:
        """The key file's status after a fresh look (None: no key file configured)."""
        if self._file is None:
            return None
        self.refresh()
        return self._file.status

    def watch(self, watcher: KeyFileWatcher) -> None:
        """Call ``watcher`` with the key file's status now and on every change."""
        self._watcher = watcher
        if self._file is not None:
            watcher(self._file.status)

    def refresh(self) -> None:
        """Look at the key file now if it is due (the health check calls this, so a bad
        edit is reported without traffic)."""
        if self._file is not None:
            with self._lock:
                self._reload()

    def _reload(self, force: bool = False) -> None:
        """Stat (at most every ``FILE_RECHECK_S``), read and hash when due, switch when good."""
        state = self._file
        assert state is not None
        now = time.monotonic()
        if not force and now - state.checked < FILE_RECHECK_S:
            return
        state.checked = now
        signature = _stat_signature(state.path)
        if signature == state.signature and now - state.hashed < FILE_REHASH_S:
            return
        state.signature, state.hashed = signature, now
        try:
            raw = None if signature is None else _read(state.path)
        except OSError as exc:
            self._refuse(f"{self._file_where}: cannot be read ({exc.strerror or exc}). Fix: "
                         "make it readable by the user the Ray workers run as.", None)
            return
        digest = None if raw is None else hashlib.sha256(raw).digest()
        if digest == state.digest:
            return
        try:
            none = raw is not None and says_no_keys(raw)
            keys = () if raw is None or none else parse_key_bytes(raw, self._file_where)
        except AuthConfigError as exc:
            self._refuse(str(exc), digest)
            return
        if raw is not None and not keys and not none:
            self._refuse(f"{self._file_where}: the read yielded no key: an edit in progress "
                         "(`cat > file` and `echo key > file` empty it first) or a mistake. "
                         "Fix: write the new file beside it and rename it over (what the "
                         "kubelet does with a Secret); to serve no key from this file on "
                         f"purpose, write the single line `{NO_KEYS}`.", digest, empty=True)
            return
        self._switch(keys, digest)

    def _switch(self, keys: tuple[str, ...], digest: bytes | None) -> None:
        """Serve ``keys`` from now on: the file's content was judged good (or is gone)."""
        state = self._file
        assert state is not None
        state.digest, state.keys, state.empty_read = digest, keys, False
        kind: KeyFileState = "missing" if digest is None else "ok"
        state.status = replace(state.status, state=kind, keys=len(keys), loaded_at=time.time(),
                               failed_at=None, problem=None)
        if kind == "missing":
            logger.warning("dsv4: API key file %s is missing: no key from it is valid "
                           "(requests fail closed with 401)", state.path)
        else:
            logger.info("dsv4: API key file %s loaded: %d key(s)", state.path, len(keys))
        self._notify()

    def _refuse(self, problem: str, digest: bytes | None, empty: bool = False) -> None:
        """Keep the last good set serving; say so once per distinct fault."""
        state = self._file
        assert state is not None
        state.empty_read = empty
        if digest is not None:
            state.digest = digest  # judged: not re-parsed until the bytes change again
        if state.status.problem == problem:
            return
        state.status = replace(state.status, state="stale", failed_at=time.time(),
                               refused=state.status.refused + 1, problem=problem)
        logger.error("dsv4: API key file edit REFUSED, still serving the last good set of "
                     "%d key(s) loaded at %s: %s", len(state.keys),
                     _when(state.status.loaded_at), problem)
        self._notify()

    def _notify(self) -> None:
        if self._watcher is not None and self._file is not None:
            self._watcher(self._file.status)

    def keys(self) -> tuple[str, ...]:
        if self._file is not None:
            with self._lock:
                self._reload()
            return self._env_keys + self._file.keys
        return self._env_keys

    def matches(self, presented: str) -> bool:
        """Constant-time check of a presented key against every valid key."""
        given = presented.encode()
        ok = False
        for key in self.keys():
            ok |= hmac.compare_digest(given, key.encode())
        return ok

    def check_startup(self, bind_host: str | None) -> None:
        """Refuse settings that cannot be honoured; called once when the ingress starts.

        A refusal fails the deployment with this message instead of serving
        without the protection the operator expects.
        """
        have = bool(self.keys())
        if self.mode == "off":
            if have or self._file is not None:
                raise AuthConfigError(
                    f"http.auth.mode=off but {', '.join(self.sources)} are configured: they "
                    "would be ignored. Fix: remove the keys (and the key file setting), or "
                    "set http.auth.mode: auto.")
            return
        if have:
            return
        if self.mode == "keys":
            raise AuthConfigError(
                f"http.auth.mode=keys but no API key is configured ({self._where()}). Fix: "
                "put keys in DSV4_API_KEYS (comma-separated) or in the file named by "
                "DSV4_API_KEYS_FILE (one per line), in the environment of the Ray cluster.")
        if not is_loopback(bind_host):
            where = (f"http_options.host={bind_host!r}" if bind_host is not None else
                     "the server replicas (Serve direct ingress is on, or the proxy's bind "
                     "address could not be read)")
            raise AuthConfigError(
                f"{where} answers beyond this machine but no API key "
                f"is configured ({self._where()}). Fix: put keys in DSV4_API_KEYS or in the "
                "file named by DSV4_API_KEYS_FILE, in the environment of the Ray cluster; or "
                "bind http_options.host: 127.0.0.1; or set http.auth.mode: off in the "
                "application args to serve without keys on purpose.")

    def _where(self) -> str:
        file = f", file {self._file.path} has none" if self._file is not None else ""
        return f"${self._env_name} is empty{file}"

    def required(self, bind_host: str | None) -> bool:
        """Whether a request needs a key now.

        ``keys``: always. ``off``: never. ``auto``: always beyond loopback; on a
        loopback address as soon as a key is configured (a key file may gain its
        first key while serving), and whenever a configured key file is missing or
        its refused edit left no key (fail closed: a key nobody has is required).
        """
        if self.mode == "off":
            return False
        if self.mode == "keys" or not is_loopback(bind_host):
            return True
        if self.keys():
            return True
        return self._file is not None and self._file.status.state != "ok"


def _read(path: Path) -> bytes:
    """The file's bytes, at most one byte over the limit (the parse refuses a larger one)."""
    with path.open("rb") as handle:
        return handle.read(MAX_KEY_FILE_BYTES + 1)


def _when(wall: float | None) -> str:
    return "never" if wall is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def preflight(config: ServeConfig, environ: dict[str, str] | None = None) -> None:
    """The ingress's startup refusal, checked before anything starts (``dsv4-serve run``).

    Same rule, same message; the ingress checks again where it runs (its
    environment is the one that counts on a remote cluster). With Serve's direct
    ingress asked for (``deployments.serve_env``) every replica listens itself, so
    the bind counts as reachable whatever ``http_options.host`` says.
    """
    host = None if serve_env.listen_requested(environ) else config.http_options.host
    for _, args in config.ours():
        KeyStore(args.http.auth, environ).check_startup(host)


def client_headers(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``Authorization`` for our own requests (``dsv4-serve run``'s checks, the tests).

    The first configured key, from the same default sources the ingress reads;
    no header when none is configured (a loopback server without keys).
    """
    store = KeyStore(AuthConfig(), environ)
    keys = store.keys()
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}
