"""A release's own DeepSeek-V4 CUDA attention selection, run from its wheel's source.

From the cached wheel (``tests/releases/sources.py``): ``_select_dsv4_attn_cls`` of
``vllm/models/deepseek_v4/nvidia/model.py``, verbatim (``ast`` cut), run with a stand-in
``AttentionBackendEnum`` and a ``current_platform`` that reports one capability; each
class it can return stands in with what that release's source says of it: the layout
flag (``use_fp8_ds_mla_layout`` / ``use_flashmla_fp8_layout``, looked up through the
class's bases, default of the base class), its backend's ``get_name`` and
``supports_compute_capability`` (verbatim, through the backend's bases; the generic
``AttentionBackend`` accepts every capability). No vLLM, torch or CUDA of the release
is imported.

Outcome of ``(capability, backend)``: ``("error",)`` when the selector raises or the
chosen backend does not support the capability, else ``(layout, backend name)``.
"""

from __future__ import annotations

import ast
import enum
import textwrap
from collections.abc import Callable, Mapping
from functools import cache
from types import SimpleNamespace
from typing import Any

from tests.releases import sources as rs

# Where the selector, its classes and their backends live (0.23+), and the 0.20-0.22 layer.
ROOTS = ("vllm/models/deepseek_v4/nvidia/", "vllm/models/deepseek_v4/attention.py",
         "vllm/models/deepseek_v4/sparse_mla.py", "vllm/model_executor/models/deepseek_v4",
         "vllm/model_executor/layers/deepseek_v4")
SKIP = ("vllm/models/deepseek_v4/nvidia/ops/",)
SELECTOR_FILE = "vllm/models/deepseek_v4/nvidia/model.py"
BASE_ATTENTION = "DeepseekV4Attention"
FLAGS = ("use_fp8_ds_mla_layout", "use_flashmla_fp8_layout")
BACKENDS = (None, "FLASHMLA_SPARSE", "FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4",
            "FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120")
CAPABILITIES = (None, (8, 0), (9, 0), (10, 0), (12, 0))

Outcome = tuple[str, ...]


@cache
def classes(version: str) -> dict[str, ast.ClassDef]:
    """Every class defined in the release's DeepSeek-V4 sources, by name."""
    found: dict[str, ast.ClassDef] = {}
    for path in sorted(rs._names(version)):
        if path.endswith(".py") and path.startswith(ROOTS) and not path.startswith(SKIP):
            for node in ast.walk(ast.parse(rs.source(version, path))):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, node)
    return found


def selector_source(version: str) -> ast.FunctionDef | None:
    if not rs.has_file(version, SELECTOR_FILE):
        return None
    node = rs._find(ast.parse(rs.source(version, SELECTOR_FILE)), ast.FunctionDef,
                    "_select_dsv4_attn_cls")
    return node if isinstance(node, ast.FunctionDef) else None


def member(cls: ast.ClassDef, name: str) -> ast.AST | None:
    """The method or class attribute ``name`` defined in ``cls``'s own body."""
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == name:
            return stmt
        targets = stmt.targets if isinstance(stmt, ast.Assign) else (
            [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
        if any(ast.unparse(t) == name for t in targets):
            return stmt
    return None


def find_member(table: Mapping[str, ast.ClassDef], cls_name: str,
                name: str) -> ast.AST | None:
    """``name`` on class ``cls_name`` or its bases, among the classes of ``table``."""
    cls = table.get(cls_name)
    if cls is None:
        return None
    own = member(cls, name)
    if own is not None:
        return own
    for base in cls.bases:
        found = find_member(table, ast.unparse(base).split(".")[-1], name)
        if found is not None:
            return found
    return None


def lookup(version: str, cls_name: str, name: str) -> ast.AST | None:
    """``name`` on class ``cls_name`` or its bases (the release's classes only)."""
    return find_member(classes(version), cls_name, name)


def _flag(table: Mapping[str, ast.ClassDef], cls_name: str) -> bool | None:
    """The first layout flag on ``cls_name`` or its bases in ``table``; None: none."""
    for flag in FLAGS:
        stmt = find_member(table, cls_name, flag)
        if stmt is not None:
            return bool(ast.literal_eval(stmt.value))  # type: ignore[attr-defined]  # find_member returns ast.AST; this member is an assignment
    return None


def layout_flag(version: str, cls_name: str) -> bool:
    flag = _flag(classes(version), cls_name)
    if flag is None:
        raise AssertionError(f"vLLM {version}: {cls_name} has none of {FLAGS}")
    return flag


def platform_layout_flag(version: str, path: str, cls_name: str) -> bool | None:
    """The layout flag of a non-CUDA DeepSeek-V4 class defined in ``path`` (its bases
    looked up in that file first, then among the release's CUDA-side classes); None
    when the release's class has no flag (``selector.is_packed``: Unavailable)."""
    own = {node.name: node for node in ast.walk(ast.parse(rs.source(version, path)))
           if isinstance(node, ast.ClassDef)}
    return _flag({**classes(version), **own}, cls_name)


def _function(node: ast.FunctionDef) -> Callable[..., Any]:
    bare = ast.FunctionDef(**{**node.__dict__, "decorator_list": []})
    namespace: dict[str, Any] = {}
    exec(compile("from __future__ import annotations\n"
                 + textwrap.dedent(ast.unparse(ast.fix_missing_locations(bare))),
                 "<release>", "exec"), namespace)
    return namespace[node.name]


def backend_of(version: str, cls_name: str) -> tuple[str, Callable[[tuple[int, int]], bool]]:
    """(get_name(), supports(capability)) of the class's ``backend_cls``."""
    stmt = lookup(version, cls_name, "backend_cls")
    backend = ast.unparse(stmt.value)  # type: ignore[union-attr]  # lookup may return None; backend_cls exists in every release
    name = _function(lookup(version, backend, "get_name"))()  # type: ignore[arg-type]  # lookup returns ast.AST | None; get_name is a FunctionDef
    check = lookup(version, backend, "supports_compute_capability")
    if check is None:  # AttentionBackend's default
        return name, lambda capability: True
    run = _function(check)  # type: ignore[arg-type]  # lookup returns ast.AST; the check is a FunctionDef
    return name, lambda capability: bool(run(None, SimpleNamespace(
        major=capability[0], minor=capability[1])))


class _Platform:
    capability: Any = None

    def get_device_capability(self, device_id: int = 0) -> Any:
        return self.capability


def selection(version: str) -> Callable[[tuple[int, int] | None, str | None], Outcome] | None:
    """The release's selection as a function of (capability, backend); None: no selector."""
    node = selector_source(version)
    if node is None:
        return None
    names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
             and ast.unparse(n.value) == "AttentionBackendEnum"}
    # (mypy: a functional Enum with computed members)
    backends = enum.Enum("AttentionBackendEnum",  # type: ignore[misc]  # a functional Enum with computed members
                         sorted(names | {b for b in BACKENDS if b}))
    returned = {ast.unparse(n.value) for n in ast.walk(node)
                if isinstance(n, ast.Return) and n.value is not None}
    stand_ins = {name: SimpleNamespace(name=name, packed=layout_flag(version, name),
                                       backend=backend_of(version, name))
                 for name in returned}
    platform = _Platform()
    namespace: dict[str, Any] = {"AttentionBackendEnum": backends, "current_platform": platform,
                                 **stand_ins}
    exec(compile("from __future__ import annotations\n" + ast.unparse(node), "<selector>",
                 "exec"), namespace)
    select = namespace[node.name]

    def outcome(capability: tuple[int, int] | None, backend: str | None) -> Outcome:
        platform.capability = None if capability is None else SimpleNamespace(
            major=capability[0], minor=capability[1])
        config = SimpleNamespace(attention_config=SimpleNamespace(
            backend=backends[backend] if backend else None))
        try:
            chosen = select(config)
        except ValueError:
            return ("error",)
        name, supports = chosen.backend
        if capability is not None and not supports(capability):
            return ("error",)
        return ("fp8_ds_mla" if chosen.packed else "plain_rows", name)

    return outcome
