"""Every reference in README.md and docs/*.md points at something that exists.

A new maintainer given only README and docs/ must not meet one wrong reference. Checked:
repo paths (``deployments/http/edge.py``, ``configs/local-cpu.yaml``), their symbol or line
(``path.py:name``, ``path.py::name``, ``path.py:123`` naming a symbol next to it), dotted
names (``deployments.app:build_app``, ``deployments.control.wire``), markdown links and their
``#anchors``, bare file names (``serve_env.py``: some file of the repo ends so, or it is a
vLLM/Ray file named in ``UPSTREAM``) and the README's layout block (each name exists under
its folder). Static only (ast): nothing is imported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from tests.support.house import REPO, defined_names, repo_files

TOPS = ("deployments", "dsv4_patch", "configs", "tests", "k8s", "docs", "benchmarks", "scripts")
ROOT_FILES = ("README.md", "Makefile", "pyproject.toml", "Dockerfile")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# vLLM / Ray / KubeRay files the docs cite by a short name (not ours; not checked here:
# tests/test_dsv4_patch/test_release_matrix.py reads the real releases).
UPSTREAM = frozenset({
    "attention.py", "cpu/model.py", "cpu/cpu_mla.py", "compressor_utils.py", "constants.py",
    "indexer.py", "models/deepseek_v41/attention.py", "models/deepseek_v4/sparse_mla.py",
    "nvidia/ops/o_proj.py", "proxy.py", "sparse_swa.py", "v1/attention/ops/metadata.py",
    "autoscaler/_private/fake_multi_node/example.yaml", "node_port_manager.py",
    "llm_server.py", "pd_server.py", "builder.py", "replica.py", "router.py",
    "config.json", "example.yaml", "ray_utils.py", "deepseek_v4.py", "metadata.py",
})
# Prefixes of upstream paths (vllm/..., ray/...).
UPSTREAM_PREFIXES = ("vllm/", "ray/", "v1/", "python/ray/", "kuberay/", "site-packages/")
# Files a reader makes: benchmark outputs, an example config of one's own.
READERS_OWN = frozenset({"configs/my.yaml"})

_EXT = r"(?:py|md|ya?ml|json|toml|txt|sh|cfg)"
_PATH = re.compile(
    r"(?<![\w./@-])((?:\.?[\w-]+/)*[\w.-]+\." + _EXT + r"(?![\w(])|(?:" + "|".join(TOPS)
    + r")/(?:[\w.-]+/)*[\w.-]*)(?:(::?)([A-Za-z_][\w.]*|\d+(?:-\d+)?))?")
_DOTTED = re.compile(r"(?<![\w./-])((?:deployments|dsv4_patch|benchmarks|tests)(?:\.\w+)+)"
                     r"(?::([A-Za-z_][\w.]*))?")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Ref:
    doc: str
    line: int
    text: str

    def where(self) -> str:
        return f"{self.doc}:{self.line} `{self.text}`"


def symbol_problem(path: Path, symbol: str) -> str | None:
    """None when ``symbol`` (``name`` or ``Cls.attr``) is defined in ``path``."""
    if path.suffix != ".py":
        return None if symbol in path.read_text() else f"{symbol!r} is not in the file"
    names = defined_names(path)
    head, *rest = symbol.split(".")
    if symbol in names:
        return None
    if head in names and rest and not any(n.startswith(head + ".") for n in names):
        return None  # an attribute of an imported name or a value: not read here
    if head in names and len(rest) > 1 and ".".join([head, rest[0]]) in names:
        return None  # an attribute of a method's result: deeper than classes go
    return f"{path.relative_to(REPO)} defines no {symbol!r}"


def line_problem(path: Path, span: str, context: str) -> str | None:
    """A ``file:line`` must still hold the symbol the text names next to it."""
    lines = path.read_text().splitlines()
    first, _, last = span.partition("-")
    lo, hi = int(first), int(last or first)
    if not 1 <= lo <= hi <= len(lines):
        return f"{path.relative_to(REPO)} has {len(lines)} lines, not {span}"
    held = "\n".join(lines[lo - 1:hi])
    named = [w for w in re.findall(r"`([A-Za-z_][\w.]*)`", context) if len(w) > 2]
    if named and not any(w.split(".")[-1] in held for w in named):
        return (f"{path.relative_to(REPO)}:{span} no longer holds any of {named} "
                f"(it reads {held.strip()[:80]!r})")
    return None


@cache
def module_file(dotted: str) -> Path | None:
    base = REPO.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def dotted_problem(dotted: str, attr: str | None) -> str | None:
    """``a.b.c[:attr]``: the longest module prefix exists and defines the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = ".".join(parts[cut:] + ([attr] if attr else []))
        if not rest:
            return None
        return symbol_problem(path, rest)
    return f"no module {parts[0]}.{parts[1] if len(parts) > 1 else ''} in the repo"


def path_problem(text: str) -> str | None:
    """A path relative to the repo root (globs allowed) exists."""
    rel = text.rstrip("/.")
    if rel in READERS_OWN:
        return None
    if any(ch in rel for ch in "*?"):
        return None if list(REPO.glob(rel)) else f"{rel} matches nothing"
    return None if (REPO / rel).exists() else f"{rel} does not exist"


def short_name_problem(text: str) -> str | None:
    """A bare or partial path: some file of ours ends with it, or it is a known upstream file."""
    if text in UPSTREAM or text.startswith(UPSTREAM_PREFIXES) or text.startswith("."):
        return None
    if not text.endswith((".py", ".yaml", ".sh", ".toml")):
        return None  # a .json/.md/.txt by a short name is an output the reader writes
    if text in ROOT_FILES or any(f == text or f.endswith("/" + text) for f in repo_files()):
        return None
    return (f"{text} is no file of the repo (nor a vLLM/Ray file listed in "
            "tests/test_house/test_docs_refs.py UPSTREAM)")


def resolve_short(text: str) -> Path | None:
    hits = [f for f in repo_files() if f == text or f.endswith("/" + text)]
    return REPO / hits[0] if len(hits) == 1 else None


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := _HEADING.match(line)):
            base, n = slug(m.group(1)), 1
            name = base
            while name in found:
                name, n = f"{base}-{n}", n + 1
            found.add(name)
    return frozenset(found)


def link_problem(doc: Path, target: str) -> str | None:
    if re.match(r"^[a-z]+:", target):
        return None  # http(s), mailto
    file_part, _, anchor = target.partition("#")
    path = (doc.parent / file_part).resolve() if file_part else doc
    if not path.exists():
        return f"link target {file_part} does not exist"
    if anchor and path.suffix == ".md" and anchor not in anchors(path):
        return f"{path.name} has no heading #{anchor}"
    return None


def layout_problems(doc: Path) -> list[tuple[Ref, str]]:
    """README's layout block: each name under a top folder exists somewhere below it."""
    text = doc.read_text()
    block = re.search(r"## Layout\n+```\n(.*?)```", text, re.S)
    if not block:
        return []
    start = text[:block.start(1)].count("\n") + 1
    found: list[tuple[Ref, str]] = []
    top: str | None = None
    for offset, line in enumerate(block.group(1).splitlines()):
        if m := re.match(r"^(\w+)/\s", line):
            top = m.group(1) if m.group(1) in TOPS else None
            line = line[m.end():]
        if top is None:
            continue
        sub = re.match(r"^\s+([\w/]+)/\s", line)
        if sub and not (REPO / top / sub.group(1)).is_dir():
            found.append((Ref(doc.name, start + offset, sub.group(1) + "/"),
                          f"{top}/{sub.group(1)}/ does not exist"))
        for name in re.findall(r"(?<![\w./`-])([\w-]+\.(?:py|yaml|md))(?![\w/])", line):
            if not any(p.name == name for p in (REPO / top).rglob(name)) \
                    and not (REPO / name).exists():
                found.append((Ref(doc.name, start + offset, name),
                              f"no {name} under {top}/"))
    return found


def problems(doc: Path) -> list[tuple[Ref, str]]:
    found: list[tuple[Ref, str]] = []
    rel = doc.relative_to(REPO).as_posix()
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for target in _LINK.findall(line):
            if (why := link_problem(doc, target)):
                found.append((Ref(rel, number, target), why))
        for m in _PATH.finditer(line):
            text, sep, tail = m.group(1), m.group(2), m.group(3)
            if "://" in line[max(0, m.start() - 40):m.start() + 1] or text.endswith("/"):
                if text.endswith("/") and text.split("/")[0] in TOPS and (
                        why := path_problem(text)):
                    found.append((Ref(rel, number, text), why))
                continue
            ours = text.split("/")[0] in TOPS or text in ROOT_FILES
            why = path_problem(text) if ours else short_name_problem(text)
            path = REPO / text if ours else resolve_short(text)
            if not why and tail and path is not None and path.is_file():
                why = (line_problem(path, tail, line) if tail[0].isdigit()
                       else symbol_problem(path, tail) if sep else None)
            if why:
                found.append((Ref(rel, number, m.group(0)), why))
        for m in _DOTTED.finditer(line):
            if re.match(r"\.(?:" + _EXT + r")\b", m.group(1)[m.group(1).rfind("."):]):
                continue
            if (why := dotted_problem(m.group(1), m.group(2))):
                found.append((Ref(rel, number, m.group(0)), why))
    return found + layout_problems(doc)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_reference_exists(doc: Path) -> None:
    found = problems(doc)
    assert not found, "references that point nowhere (fix the doc, or the name moved):\n" \
        + "\n".join(f"  {ref.where()}: {why}" for ref, why in found)


def test_the_checker_catches_drift(tmp_path: Path) -> None:
    """Each kind of wrong reference is caught; each right one passes."""
    assert path_problem("deployments/serving/serve_env.py")
    assert not path_problem("deployments/serve_env.py")
    assert dotted_problem("deployments.app", "no_such_name")
    assert not dotted_problem("deployments.app", "build_app")
    assert dotted_problem("deployments.nowhere", None)
    assert short_name_problem("cpu_gate.py")
    assert not short_name_problem("serve_env.py")
    assert symbol_problem(REPO / "deployments/ray_touches/probes.py", "RayTouch.nope")
    assert not symbol_problem(REPO / "deployments/ray_touches/probes.py", "RayTouch")
    at = next(i for i, line in enumerate(
        (REPO / "deployments/ray_touches/probes.py").read_text().splitlines(), 1)
        if line.startswith("class RayTouch"))
    assert not line_problem(REPO / "deployments/ray_touches/probes.py", str(at), "`RayTouch`")
    assert line_problem(REPO / "deployments/ray_touches/probes.py", str(at + 3), "`RayTouch`")
    assert line_problem(REPO / "deployments/ray_touches/probes.py", "99999", "`RayTouch`")
    doc = tmp_path / "x.md"
    doc.write_text("# Two doors: here\n")
    assert not link_problem(doc, "#two-doors-here")
    assert link_problem(doc, "#three-doors")


_SECTION = re.compile(r"(docs/[\w-]+\.md) §(\d+[a-z]?)(?:[–-](\d+[a-z]?))?")


def section_labels(doc: Path) -> frozenset[str]:
    """The ``N.`` / ``Na.`` labels a doc's headings start with."""
    return frozenset(m.group(1) for line in doc.read_text().splitlines()
                     if (m := re.match(r"^#{2,6}\s+(\d+[a-z]?)\.\s", line)))


def test_every_section_reference_names_a_section() -> None:
    """``docs/benchmarks.md §2f`` in code or docs names a heading that exists."""
    wrong = []
    for rel in repo_files():
        if not rel.endswith((".py", ".md")):
            continue
        for number, line in enumerate((REPO / rel).read_text().splitlines(), 1):
            for m in _SECTION.finditer(line):
                doc = REPO / m.group(1)
                labels = section_labels(doc) if doc.is_file() else frozenset()
                missing = [s for s in m.group(2, 3) if s and s not in labels]
                if missing:
                    wrong.append(f"{rel}:{number} `{m.group(0)}`: {m.group(1)} has no "
                                 f"section {', '.join(missing)}")
    assert not wrong, "\n".join(wrong)
    assert {"2a", "2g", "8"} <= section_labels(REPO / "docs" / "benchmarks.md")
