"""The token of Ray's token auth for a cluster dsv4-serve starts: this user's alone (0600).

Ray 2.60 turns token auth on for a new local cluster and, when no token path is given,
writes ``~/.ray/auth_token`` with the process's umask (0644 here: any local user reads
it and drives the cluster; loopback is no boundary between users). A start by
dsv4-serve therefore names its token: ``RAY_AUTH_TOKEN_PATH`` when the operator set it,
else a new file of its own created 0600; either is checked (a regular file of this user,
no group/others access) and anything else is refused with the path and the fix.
``RAY_AUTH_MODE=disabled`` set by the operator is left as set (Ray then warns).
"""

from __future__ import annotations

import os
import stat
import tempfile
import uuid
from pathlib import Path

MODE_ENV, PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"


class TokenFileError(RuntimeError):
    """A Ray auth token file another user could read or replace; names it and the fix."""


def check_token(path: Path) -> None:
    """Refuse a token file that is not a regular file of this user with mode 0600."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise TokenFileError(f"the Ray auth token {path} is not a regular file (a symlink?): "
                             f"it could point anywhere. Fix: replace it with a file of "
                             f"your own (mode 600), or unset {PATH_ENV}.")
    if info.st_uid != os.geteuid():
        raise TokenFileError(f"the Ray auth token {path} belongs to uid {info.st_uid}, not "
                             f"to this user (uid {os.geteuid()}). Fix: use a token file of "
                             "your own (mode 600).")
    if info.st_mode & 0o077:
        raise TokenFileError(f"the Ray auth token {path} has mode "
                             f"{stat.S_IMODE(info.st_mode):o}: other local users can read "
                             f"it and drive the cluster. Fix: chmod 600 {path}")


def new_token(path: Path) -> None:
    """Write a fresh token at ``path``, created 0600 (never through a symlink)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(uuid.uuid4().hex)


def token_env(path: Path | None = None,
              environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """The env that makes Ray use a checked, private token: ``path`` (created when
    missing), else the operator's ``RAY_AUTH_TOKEN_PATH``, else a new file of ours."""
    if environ.get(MODE_ENV, "").lower() == "disabled":
        return {}
    if path is None and environ.get(PATH_ENV):
        path = Path(environ[PATH_ENV])
    if path is None:
        fd, name = tempfile.mkstemp(prefix="dsv4-ray-", suffix=".token")  # 0600, O_EXCL
        os.close(fd)
        path = Path(name)
        path.unlink()
    if not path.exists() and not path.is_symlink():
        new_token(path)
    check_token(path)
    return {MODE_ENV: "token", PATH_ENV: str(path)}


def local_start_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """``token_env`` for a start by ``ray.init`` in a process that already imported Ray.

    The token path only: Ray caches its auth mode when imported, and a
    ``RAY_AUTH_MODE`` set afterwards reaches the GCS (inherited) but not this driver,
    which then cannot connect. Left unset, ``ray.init`` turns token mode on itself for
    a new local cluster and refreshes its cached config; an operator's own mode (set
    before the process started) is kept as set.
    """
    env = token_env(environ=environ)
    if MODE_ENV not in environ:
        env.pop(MODE_ENV, None)
    return env


def use_private_token() -> str | None:
    """Before ``ray.init(address="local")`` in this process: its token is checked and
    private (``local_start_env`` set in ``os.environ``); returns the token's path."""
    os.environ.update(local_start_env())
    return os.environ.get(PATH_ENV)
