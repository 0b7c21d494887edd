"""API keys for the HTTP edge: where they come from, how they are compared, when to refuse.

Keys never live in the Serve YAML (a config is committed, rendered into KubeRay
manifests and shown by ``serve status``/the dashboard). They come from the
process environment of the ingress replica:

* ``DSV4_API_KEYS``: one or more keys separated by commas or whitespace;
* ``DSV4_API_KEYS_FILE`` (or ``http.auth.keys_file``): a file with one key per
  line (``#`` comments allowed). A Kubernetes Secret mounted as a volume is such a
  file; the kubelet rewrites it in place when the Secret changes, and the file is
  re-read when its modification time changes (looked at once a second), so a key
  rotates without a restart. A missing or empty file holds no key.

Several keys are valid at once: that is how a key rotates (add the new one, move
clients, remove the old one). Comparison is constant-time per key
(``hmac.compare_digest``) and every configured key is compared, so the time taken
does not say which key, or how much of one, matched.

Whether a key is needed at all (``http.auth.mode``): ``keys`` always; ``off``
never (and then no key may be configured, so nobody believes one protects them);
``auto`` (the default) needs one beyond a loopback address, and on a loopback
address as soon as one is configured; so ``make run`` on 127.0.0.1 works for a
new user without a key while nothing that answers beyond this machine answers
without one (the ingress refuses to start instead).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from deployments import serve_env
from deployments.config import AuthConfig, ConfigError, ServeConfig

MIN_KEY_CHARS = 16
# How often the key file's modification time is looked at (a stat, not a read).
FILE_RECHECK_S = 1.0


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
            "that short can be guessed. Fix: generate one with "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`.")
    return tuple(dict.fromkeys(keys))


@dataclass
class _FileState:
    path: Path
    mtime_ns: int = -1
    checked: float = 0.0
    keys: tuple[str, ...] = ()


class KeyStore:
    """The valid keys of this process: env keys plus the (re-read) key file."""

    def __init__(self, config: AuthConfig, environ: dict[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.mode = config.mode
        self._env_name = config.keys_env
        self._env_keys = parse_keys(env.get(config.keys_env, ""), f"${config.keys_env}")
        path = config.keys_file or env.get(config.keys_file_env) or None
        self._file = _FileState(Path(path)) if path else None
        self._file_where = (f"http.auth.keys_file={path!r}" if config.keys_file
                            else f"${config.keys_file_env}={path!r}")
        self._lock = threading.Lock()
        if self._file is not None:
            self._reload(force=True)

    @property
    def sources(self) -> list[str]:
        """Where keys come from, for logs and errors (never the keys)."""
        found = []
        if self._env_keys:
            found.append(f"{len(self._env_keys)} key(s) from the environment")
        if self._file is not None:
            found.append(f"{len(self._file.keys)} key(s) from {self._file.path}")
        return found

    def _reload(self, force: bool = False) -> None:
        state = self._file
        assert state is not None
        now = time.monotonic()
        if not force and now - state.checked < FILE_RECHECK_S:
            return
        state.checked = now
        try:
            mtime = state.path.stat().st_mtime_ns
        except OSError:
            mtime = None  # missing: no keys from the file (requests then fail closed)
        if mtime == state.mtime_ns:
            return
        state.mtime_ns = mtime
        state.keys = () if mtime is None else parse_keys(state.path.read_text(),
                                                         self._file_where)

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
            if have:
                raise AuthConfigError(
                    f"http.auth.mode=off but {', '.join(self.sources)} are configured: they "
                    "would be ignored. Fix: remove the keys, or set http.auth.mode: auto.")
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
        first key while serving), so configuring a key always takes effect.
        """
        if self.mode == "off":
            return False
        if self.mode == "keys" or not is_loopback(bind_host):
            return True
        return bool(self.keys())


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
