"""Ray's auth token for a cluster dsv4-serve starts is this user's alone (issue 52).

Ray 2.60, left to itself, writes ``~/.ray/auth_token`` with the umask's mode (0644):
any local user could read it and drive the cluster. The start names a private token
(created 0600), so Ray's own setup (run here, for real, with HOME in a temp directory)
writes nothing; a group/world-readable, foreign or symlinked token is refused naming it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from deployments.local import ray_token


def _ray_setup(home: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's own token setup for a new local cluster (what ray.init runs first)."""
    from ray._private.authentication import authentication_token_setup as setup

    loader = setup.AuthenticationTokenLoader

    monkeypatch.setenv("HOME", str(home))
    for name in (ray_token.MODE_ENV, ray_token.PATH_ENV, "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    loader.instance().reset_cache()
    setup._enable_token_auth()  # what ray.init does for a new local cluster
    setup.ensure_token_if_auth_enabled(create_token_if_missing=True)
    loader.instance().reset_cache()


def test_a_local_start_leaves_no_readable_token(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    env = ray_token.token_env(environ={})
    token = Path(env[ray_token.PATH_ENV])
    try:
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        _ray_setup(tmp_path, env, monkeypatch)
        default = tmp_path / ".ray" / "auth_token"
        assert not default.exists() or stat.S_IMODE(default.stat().st_mode) & 0o077 == 0, (
            f"Ray wrote {default} with mode {stat.S_IMODE(default.stat().st_mode):o}")
    finally:
        token.unlink()


@pytest.mark.parametrize("case", ["world_readable", "group_readable", "symlink"])
def test_a_start_on_a_readable_token_is_refused_naming_it(tmp_path: Path, case: str) -> None:
    token = tmp_path / "auth_token"
    if case == "symlink":
        (tmp_path / "real").write_text("t")
        (tmp_path / "real").chmod(0o600)
        token.symlink_to(tmp_path / "real")
    else:
        token.write_text("t")
        token.chmod(0o644 if case == "world_readable" else 0o640)
    with pytest.raises(ray_token.TokenFileError, match="Fix") as err:
        ray_token.token_env(environ={ray_token.PATH_ENV: str(token)})
    assert str(token) in str(err.value)


def test_the_multinode_cluster_token_is_private(tmp_path: Path) -> None:
    from deployments.local.cluster import auth_env

    env = auth_env(tmp_path / "c.token")
    assert stat.S_IMODE(os.stat(env[ray_token.PATH_ENV]).st_mode) == 0o600


def test_use_private_token_sets_a_0600_token_for_this_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ray_token.MODE_ENV, ray_token.PATH_ENV, "RAY_AUTH_TOKEN"):
        monkeypatch.setenv(name, "")  # recorded: the env is restored after the test
        monkeypatch.delenv(name)
    path = Path(ray_token.use_private_token() or "")
    try:
        assert os.environ[ray_token.PATH_ENV] == str(path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert ray_token.MODE_ENV not in os.environ  # ray.init sets the mode itself
    finally:
        path.unlink()
