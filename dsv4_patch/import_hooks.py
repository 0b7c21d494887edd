"""Run a callback right after a module is imported, without importing it ourselves.

Why: the plugin runs in every vLLM process, most of which never build a
DeepSeek-V4 layer. Importing ``vllm.models.deepseek_v4.attention`` just to patch
it costs seconds (it compiles Triton kernels and pulls the MLA stack), so the
plugin registers a post-import callback instead: zero cost unless DSv4 is used,
and the patch lands before any caller can reach the patched symbol.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_callbacks: dict[str, list[Callback]] = {}
_resolving: set[str] = set()


class _NotifyingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the callbacks of the module."""

    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back so inspect/linecache/Triton see the usual one.
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        _fire(self._name, module)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of the watched modules."""

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        with _lock:
            if fullname not in _callbacks or fullname in _resolving:
                return None
            _resolving.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            with _lock:
                _resolving.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _NotifyingLoader(spec.loader, fullname)
        return spec


_finder = _PostImportFinder()


def _fire(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _callbacks.pop(name, [])
    for callback in callbacks:
        callback(module)


def when_imported(name: str, callback: Callback) -> bool:
    """Call ``callback(module)`` once ``name`` is imported; now if it already is.

    Callbacks for one module run in registration order. Returns True when the
    callback ran immediately (the module was already imported).
    """
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return True
    with _lock:
        _callbacks.setdefault(name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    return False


def module_exists(name: str) -> bool:
    """Whether module ``name`` is installed, judged from files without importing it.

    ``importlib.util.find_spec("a.b.c")`` would import the packages ``a`` and ``a.b``;
    for vLLM's DeepSeek-V4 package that builds the whole model stack. Only the top-level
    package is located (that imports nothing); the rest is looked up on disk.
    """
    if name in sys.modules:
        return True
    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None:
        return False
    if not rest:
        return True
    roots = list(spec.submodule_search_locations or [])
    return any(os.path.isfile(os.path.join(root, *rest) + ".py")
               or os.path.isfile(os.path.join(root, *rest, "__init__.py")) for root in roots)
