"""The SQLite store's file and directory: ours alone, checked before the first byte is written.

The store holds every stored prompt and answer. Its default directory is per user
(``$XDG_STATE_HOME`` or ``~/.local/state``, then ``dsv4-serve/responses``), created
0700; the file is created 0600 (SQLite gives its ``-wal``/``-shm`` files the
database file's mode). A directory or file that is a symlink, is another user's, or
that group/others can reach is refused at start with its path and the fix: a directory
another local user made first (or can write into) would let them read every prompt or
write into another key's next turn.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_MODE, FILE_MODE = 0o700, 0o600


class PrivatePathError(RuntimeError):
    """A store path this process will not use; the message names it and the fix."""


def default_dir() -> Path:
    """This user's state directory for the stores (not shared with other users)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "dsv4-serve" / "responses"


def _check(path: Path, kind: str) -> None:
    info = os.lstat(path)
    fix = (f"Fix: remove it or set responses.sqlite_path to a {kind} of your own "
           f"(mode {DIR_MODE if kind == 'directory' else FILE_MODE:o}).")
    if stat.S_ISLNK(info.st_mode):
        raise PrivatePathError(f"the Responses store {kind} {path} is a symlink: it could "
                               f"point anywhere another user chose. {fix}")
    if info.st_uid != os.geteuid():
        raise PrivatePathError(f"the Responses store {kind} {path} belongs to uid "
                               f"{info.st_uid}, not to this process (uid {os.geteuid()}): "
                               f"its owner could read every stored prompt. {fix}")
    if info.st_mode & 0o077:
        raise PrivatePathError(f"the Responses store {kind} {path} has mode "
                               f"{stat.S_IMODE(info.st_mode):o}: group/others can reach it "
                               f"and read stored prompts. Fix: chmod "
                               f"{DIR_MODE if kind == 'directory' else FILE_MODE:o} {path}, "
                               "or set responses.sqlite_path elsewhere.")


def prepare(file: Path) -> None:
    """Create ``file``'s directory (0700) and the file (0600) if missing; refuse either
    when it is not private to this user (``PrivatePathError``)."""
    directory = file.parent
    if not directory.exists():
        directory.mkdir(mode=DIR_MODE, parents=True)
    _check(directory, "directory")
    try:
        fd = os.open(file, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, FILE_MODE)
        os.close(fd)
    except FileExistsError:
        pass
    _check(file, "file")
