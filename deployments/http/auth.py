"""API keys for the HTTP edge: where they come from, how they are compared, when to refuse.

Keys never live in the Serve YAML; they come from the ingress replica's environment:
``DSV4_API_KEYS`` (comma/space separated) and the file named by ``DSV4_API_KEYS_FILE``
or ``http.auth.keys_file`` (one key per line, ``#`` comments; a mounted Kubernetes
Secret). The file is stat-ed at most every ``FILE_RECHECK_S``, re-read on a change and
every ``FILE_REHASH_S`` anyway, and judged by the SHA-256 of its bytes.

An edit is **parsed first and switched to only when good** (``keyfile``: what a key
looks like, ``NO_KEYS``). A bad edit -- no key at all (``cat > keys`` empties the file
first) unless the file says ``none``, a key of the wrong shape (half written), not
UTF-8, unreadable, too large -- keeps the last good set serving and says so: an ERROR
line naming the file, ``KeyFileStatus`` in ``GET /v1/kv-spec`` and metrics; never to
an HTTP caller. At startup a bad file refuses to start; a file with no key starts
failing closed. Keys compare in constant time, every key every time.

``http.auth.mode``: ``keys`` always needs one; ``off`` never (and no key may be
configured); ``auto`` needs one beyond loopback, and on loopback once one is
configured or while a configured key file is missing, empty or refused (fail
closed). docs/security.md has the whole story.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

from deployments import serve_env
from deployments.config import AuthConfig, ServeConfig
from deployments.http.keyfile import (
    KEY_SHAPE,
    KEY_SHAPE_TEXT,
    MAX_KEY_FILE_BYTES,
    MIN_KEY_CHARS,
    NO_KEYS,
    AuthConfigError,
    FileState,
    KeyFileState,
    KeyFileStatus,
    KeyFileWatcher,
    bearer_token,
    is_loopback,
    parse_key_bytes,
    parse_keys,
    read_capped,
    says_no_keys,
    stat_signature,
    when,
)
from deployments.logs import get_logger

logger = get_logger("auth")

__all__ = ["KEY_SHAPE", "KEY_SHAPE_TEXT", "MAX_KEY_FILE_BYTES", "MIN_KEY_CHARS", "NO_KEYS",
           "AuthConfigError", "KeyFileStatus", "KeyFileWatcher", "KeyStore", "bearer_token",
           "client_headers", "is_loopback", "parse_key_bytes", "parse_keys", "preflight"]

# How often the key file is looked at (a stat, not a read).
FILE_RECHECK_S = 1.0
# How often it is re-read and hashed even when the stat looks unchanged: a copy
# that keeps size and mtime (``cp -p``), or a file system with coarse timestamps.
FILE_REHASH_S = 10.0
class KeyStore:
    """The valid keys of this process: env keys plus the (re-read) key file."""

    def __init__(self, config: AuthConfig, environ: dict[str, str] | None = None,
                 watcher: KeyFileWatcher | None = None):
        env = os.environ if environ is None else environ
        self.mode = config.mode
        self._env_name = config.keys_env
        self._env_keys = parse_keys(env.get(config.keys_env, ""), f"${config.keys_env}")
        path = config.keys_file or env.get(config.keys_file_env) or None
        self._file = FileState(Path(path)) if path else None
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
        signature = stat_signature(state.path)
        if signature == state.signature and now - state.hashed < FILE_REHASH_S:
            return
        state.signature, state.hashed = signature, now
        try:
            raw = None if signature is None else read_capped(state.path)
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
                     when(state.status.loaded_at), problem)
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
