"""Where the shipped Serve configs and KubeRay params live: a checkout or the installed wheel.

In a source checkout (and an editable install) they are the repository's top-level
``configs/`` and ``k8s/``. A wheel carries the same files as package data under
``deployments/_data/`` (pyproject.toml maps them there), read with
``importlib.resources``, so ``pip install dsv4-serve`` then ``dsv4-serve run`` finds
its default config and every error's Fix names a path that exists.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent
_MARKER = Path("configs") / "local-cpu.yaml"


def data_root() -> Path:
    """The directory holding ``configs/`` and ``k8s/`` (checkout first, then the wheel's)."""
    if (_CHECKOUT / _MARKER).is_file():
        return _CHECKOUT
    shipped = Path(str(files("deployments").joinpath("_data")))
    if (shipped / _MARKER).is_file():
        return shipped
    raise FileNotFoundError(
        f"neither {_CHECKOUT / _MARKER} nor {shipped / _MARKER} exists: this dsv4-serve "
        "install lacks its configs. Fix: reinstall the package (pip install --force-reinstall "
        "dsv4-serve) or run from a source checkout.")


def configs_dir() -> Path:
    """The shipped Serve configs (``local-cpu.yaml``, the GPU presets, ``models/``)."""
    return data_root() / "configs"


def k8s_dir() -> Path:
    """``params.yaml`` and the RayService manifests rendered from the presets."""
    return data_root() / "k8s"
