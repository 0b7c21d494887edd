"""DeepSeek-V4.1's KV decisions, run from each released wheel's own source (0.30.0+).

For one (release, platform) the wheel's decision code is cut out with ``ast`` and run
here without the release's torch, CUDA or C++ (``tests/releases/sources.py`` downloads
the wheel once). Executed from the wheel, verbatim:

* the attention class selection: ``_select_dsv4_attn_cls`` of ``deepseek_v41/nvidia/model.py``
  (CUDA) or ``deepseek_v41/amd/model.py`` (ROCm), with ``current_platform`` standing in
  for the GPU (its ``is_device_capability_family`` is the wheel's own, over a stand-in
  ``get_device_capability``: SM90 (9, 0), SM100 (10, 0), SM120 (12, 0), gfx942 (9, 4),
  gfx950 (9, 5) as ``platforms/rocm.py`` derives them);
* mega attention's ``is_available_for`` and ``is_flashmla_mega_attn_supported`` (the
  kernel-availability check: FlashMLA sparse and the ``_flashmla_C`` mega ops answer as a
  released CUDA wheel on that GPU does: present);
* the chosen class's backend: ``get_name``, ``supports_compute_capability``, the layout
  flag and ``packed_kv_cache_dtype``;
* the dtype and record: the statements of ``DeepseekV4Attention.__init__`` from the
  resolver call to the record/alignment (and nvfp4 refusal), with the wheel's resolver
  ``_resolve_dsv4_kv_cache_dtype`` and ``_use_v41_mxfp8_kv_record``;
* the main and indexer ``get_kv_cache_spec`` (the spec class stands in, keeping its
  arguments), ``_indexer_k_cache_head_dim``;
* every backend's ``get_supported_kernel_block_sizes`` and ``supports_block_size``, and
  the platform's block choice: ``Platform._preferred_block_size_for_backends`` (0.31+) or
  the first backend's ``get_preferred_block_size`` (0.30), from ``CacheConfig.DEFAULT_BLOCK_SIZE``;
* the DSpark draft-layer count (``num_dspark_layers`` in ``nvidia/dspark.py``).

Read from source, not executed (pinned by tests/test_dsv4_patch/test_release_differential.py):
the page arithmetic of the spec classes (``_apply_alignment_padding``: a page is
``round_up(states x bytes per state, alignment)``), and that a ``--block-size`` every
backend does not accept is refused.
"""

from __future__ import annotations

import ast
import contextlib
import enum
import itertools
import math
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any

from tests.releases import sources as rs
from tests.releases.selector import find_member, member

V41_RELEASES = ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
GPUS: dict[str, tuple[str, tuple[int, int]]] = {
    "sm90": ("cuda", (9, 0)), "sm100": ("cuda", (10, 0)), "sm120": ("cuda", (12, 0)),
    "gfx942": ("rocm", (9, 4)), "gfx950": ("rocm", (9, 5)),
}
ROOTS = ("vllm/models/deepseek_v41/", "vllm/v1/attention/backends/mla/indexer.py",
         "vllm/v1/attention/backends/mla/rocm_paged_mxfp4_indexer.py",
         "vllm/v1/attention/backends/mla/sparse_swa.py", "vllm/v1/attention/backend.py")
SKIP = ("/ops/", "/specialized_decode/", "/mono/")
ATTN = "vllm/models/deepseek_v41/attention.py"
BACKEND = "vllm/v1/attention/backend.py"
INTERFACE = "vllm/platforms/interface.py"
CACHE = "vllm/config/cache.py"
FUSED_LAYOUT = "vllm/models/deepseek_v41/common/ops/fused_layout.py"
MEGA = "vllm/models/deepseek_v41/nvidia/flash_mla_mega_attn.py"
DSPARK = "vllm/models/deepseek_v41/nvidia/dspark.py"
KV_INTERFACE = "vllm/v1/kv_cache_interface.py"
INDEXER = "vllm/v1/attention/backends/mla/indexer.py"


class Refused(Exception):
    """vLLM's own code raised (or a backend declined the GPU): the cell is a refusal."""


@dataclass(frozen=True)
class Outcome:
    """What the wheel's code builds for one cell (or ``refused``: why not)."""

    backend: str = ""
    cache_dtype_str: str = ""
    block_size: int = 0
    pages: tuple[tuple[str, int], ...] = ()  # ("main c2", bytes), ("indexer c1", ...), ...
    bytes_per_token: float = 0.0
    draft_layers: int = 0
    refused: str | None = None


@cache
def classes(version: str) -> dict[str, ast.ClassDef]:
    found: dict[str, ast.ClassDef] = {}
    for path in sorted(rs._names(version)):
        if path.endswith(".py") and path.startswith(ROOTS) and not any(s in path for s in SKIP):
            for node in ast.walk(ast.parse(rs.source(version, path))):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, node)
    return found


@cache
def lookup(version: str, cls_name: str, name: str) -> ast.AST | None:
    """``name`` on class ``cls_name`` or its bases (the release's own classes)."""
    return find_member(classes(version), cls_name, name)


def function(node: ast.AST, namespace: dict[str, Any]) -> Callable[..., Any]:
    """A function of the wheel, decorators dropped, defined in ``namespace``."""
    assert isinstance(node, ast.FunctionDef), node
    bare = ast.FunctionDef(**{**node.__dict__, "decorator_list": []})
    code = "from __future__ import annotations\n" + textwrap.dedent(
        ast.unparse(ast.fix_missing_locations(bare)))
    exec(compile(code, f"<{node.name}>", "exec"), namespace)
    return namespace[node.name]


@cache
def module_function(version: str, path: str, name: str) -> ast.FunctionDef | None:
    if not rs.has_file(version, path):
        return None
    node = rs._find(ast.parse(rs.source(version, path)), ast.FunctionDef, name)
    return node if isinstance(node, ast.FunctionDef) else None


@cache
def module_constant(version: str, path: str, name: str) -> Any:
    for stmt in ast.parse(rs.source(version, path)).body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else (
            [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
        if any(ast.unparse(t) == name for t in targets):
            return ast.literal_eval(stmt.value)  # type: ignore[attr-defined]  # an (Ann)Assign
    raise LookupError(f"vLLM {version}: no {name} in {path}")


def class_constant(version: str, cls: str, name: str) -> Any:
    stmt = lookup(version, cls, name)
    assert stmt is not None, (version, cls, name)
    return ast.literal_eval(stmt.value)  # type: ignore[attr-defined]  # lookup returns ast.AST; this member is an assignment


class MultipleOf:
    def __init__(self, base: int) -> None:
        self.base = base


class Capability(SimpleNamespace):
    def to_int(self) -> int:
        return self.major * 10 + self.minor


class Platform:
    """``current_platform`` of one GPU; capability questions are the wheel's own code."""

    def __init__(self, version: str, kind: str, capability: tuple[int, int]) -> None:
        self.kind, self.cap = kind, Capability(major=capability[0], minor=capability[1])
        family = lookup_interface(version, "is_device_capability_family")
        self._family = function(family, {})

    def get_device_capability(self, device_id: int = 0) -> Capability:
        return self.cap

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        return bool(self._family(self, capability, device_id))

    def is_device_capability(self, capability: Any, device_id: int = 0) -> bool:
        return self.cap.to_int() == (capability if isinstance(capability, int)
                                     else capability[0] * 10 + capability[1])

    def is_rocm(self) -> bool:
        return self.kind == "rocm"

    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def is_cuda_alike(self) -> bool:
        return True


@cache
def lookup_interface(version: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(rs.source(version, INTERFACE))
    cls = rs._find(tree, ast.ClassDef, "Platform")
    node = member(cls, name)
    assert isinstance(node, ast.FunctionDef), (version, name)
    return node


class _AnyOps:
    """``torch.ops._flashmla_C`` of a released CUDA wheel: every op is built."""

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


class _Logger:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


class Backend:
    """A stand-in backend class: its wheel methods bound to it."""

    def __init__(self, version: str, name: str, platform: Platform) -> None:
        self.cls_name = name
        ns = {"current_platform": platform, "MultipleOf": MultipleOf}
        sizes = lookup(version, name, "get_supported_kernel_block_sizes")
        self._sizes = function(sizes, dict(ns)) if sizes is not None else (lambda *a: [])
        self._name = function(lookup(version, name, "get_name"), dict(ns))  # type: ignore[arg-type]  # lookup may return None; get_name exists on every backend
        check = lookup(version, name, "supports_compute_capability")
        self._cap = function(check, dict(ns)) if check is not None else None
        self._supports = function(lookup(version, name, "supports_block_size"),  # type: ignore[arg-type]  # lookup may return None; exists on every backend
                                  dict(ns))
        self._preferred = function(lookup(version, name, "get_preferred_block_size"),  # type: ignore[arg-type]  # lookup may return None; exists on every backend
                                   dict(ns))

    def get_supported_kernel_block_sizes(self, kv_cache_spec: Any = None) -> list[Any]:
        return self._sizes()

    def get_name(self) -> str:
        return self._name()

    def supports_compute_capability(self, capability: Any) -> bool:
        return True if self._cap is None else bool(self._cap(self, capability))

    def supports_block_size(self, block_size: int | None) -> bool:
        return bool(self._supports(self, block_size))

    def get_preferred_block_size(self, default_block_size: int) -> int:
        return self._preferred(self, default_block_size)


def _class_ref(version: str, cls: str, name: str) -> str | None:
    stmt = lookup(version, cls, name)
    if stmt is None or getattr(stmt, "value", None) is None:
        return None
    text = ast.unparse(stmt.value)  # type: ignore[attr-defined]  # checked above: stmt has a value
    return None if text == "None" else text


class Release:
    """One release on one GPU: the wheel's decision functions, ready to call per cell."""

    def __init__(self, version: str, gpu: str) -> None:
        self.version, self.gpu = version, gpu
        kind, cap = GPUS[gpu]
        self.kind = kind
        self.platform = Platform(version, kind, cap)
        self.default_block = class_constant(version, "CacheConfig", "DEFAULT_BLOCK_SIZE") \
            if lookup(version, "CacheConfig", "DEFAULT_BLOCK_SIZE") else \
            _cache_default_block(version)
        ns: dict[str, Any] = {"current_platform": self.platform, "torch": _torch(),
                              "logger": _Logger(), "CacheConfig": object}
        # (mypy: module_function may return None; these exist in every V4.1 release.)
        self.resolver = function(module_function(  # type: ignore[arg-type]  # may return None; exists in every V4.1 release
            version, ATTN, "_resolve_dsv4_kv_cache_dtype"), ns)
        self.mxfp8 = function(module_function(version, ATTN, "_use_v41_mxfp8_kv_record"), ns)  # type: ignore[arg-type]  # may return None; exists in every V4.1 release
        mxfp4_block = 32  # MXFP4_BLOCK_SIZE (pinned by the differential test)
        self.indexer_head = function(module_function(  # type: ignore[arg-type]  # may return None; exists in every V4.1 release
            version, ATTN, "_indexer_k_cache_head_dim"), {"MXFP4_BLOCK_SIZE": mxfp4_block})
        self._backends: dict[str, Backend] = {}
        self.select = self._selector()

    # ---------------------------------------------------------------- selection
    def _selector(self) -> Callable[[Any], str]:
        path = ("vllm/models/deepseek_v41/amd/model.py" if self.kind == "rocm"
                else "vllm/models/deepseek_v41/nvidia/model.py")
        node = module_function(self.version, path, "_select_dsv4_attn_cls")
        assert node is not None, (self.version, path)
        self.enum = enum.Enum("AttentionBackendEnum", registry_names(self.version))  # type: ignore[misc]  # a functional Enum with computed members
        returned = {ast.unparse(n.value) for n in ast.walk(node)
                    if isinstance(n, ast.Return) and n.value is not None}
        ns: dict[str, Any] = {"AttentionBackendEnum": self.enum,
                              "current_platform": self.platform, "logger": _Logger()}
        for name in returned:
            ns[name] = SimpleNamespace(name=name, is_available_for=self._mega_check(name))
        fn = function(node, ns)
        return lambda cfg: fn(cfg).name

    def _mega_check(self, cls: str) -> Callable[[Any], bool] | None:
        node = lookup(self.version, cls, "is_available_for")
        if node is None:
            return None
        supported = module_function(self.version, MEGA, "is_flashmla_mega_attn_supported")
        ns: dict[str, Any] = {"current_platform": self.platform,
                              "torch": SimpleNamespace(ops=SimpleNamespace(_flashmla_C=_AnyOps())),
                              "is_flashmla_sparse_supported": lambda: (True, None),
                              "WV_GROUP_SIZE": module_constant(self.version, FUSED_LAYOUT,
                                                               "WV_GROUP_SIZE")}
        ns["is_flashmla_mega_attn_supported"] = function(supported, ns)  # type: ignore[arg-type]  # may be None; present where mega attention exists
        check = function(node, ns)
        return lambda cfg: bool(check(None, cfg))

    def backend(self, cls: str) -> Backend:
        ref = _class_ref(self.version, cls, "backend_cls")
        assert ref is not None, (self.version, cls)
        return self.backend_named(ref)

    def backend_named(self, name: str) -> Backend:
        if name not in self._backends:
            self._backends[name] = Backend(self.version, name, self.platform)
        return self._backends[name]

    # ---------------------------------------------------------------- one cell
    def run(self, cell: Cell, hf: Mapping[str, Any]) -> Outcome:
        try:
            return self._run(cell, hf)
        except (Refused, ValueError, NotImplementedError, KeyError) as exc:
            return Outcome(refused=f"{type(exc).__name__}: {exc}")

    def _run(self, cell: Cell, hf: Mapping[str, Any]) -> Outcome:
        if cell.backend and cell.backend not in self.enum.__members__:
            raise Refused(f"vLLM {self.version} has no attention backend {cell.backend}")
        backend_enum = self.enum[cell.backend] if cell.backend else None
        cfg = SimpleNamespace(
            attention_config=SimpleNamespace(backend=backend_enum),
            parallel_config=SimpleNamespace(prefill_context_parallel_size=1,
                                            tensor_parallel_size=cell.tp),
            lora_config=object() if cell.lora else None,
            model_config=SimpleNamespace(hf_config=SimpleNamespace(**hf)))
        cls = self.select(cfg)
        self._init_checks(cls, hf, cell.tp)
        main = self.backend(cls)
        if not main.supports_compute_capability(self.platform.cap):
            raise Refused(f"{main.get_name()} does not support {self.gpu}")
        layer = self._record(cls, cell.kv_cache_dtype)
        rocm_mxfp4 = self._indexer_fp4(cell.indexer_mxfp4) and self.kind == "rocm"
        swa_ref = _class_ref(self.version, cls, "swa_backend_cls") or "DeepseekSparseSWABackend"
        indexer = ("DeepseekV41RocmMxfp4IndexerBackend" if rocm_mxfp4 else
                   "DeepseekV41IndexerBackend")
        backends = [main, self.backend_named(swa_ref), self.backend_named(indexer),
                    self.backend_named("CompressorBackend")]
        block = self._block(backends, cell.block_size)
        pages = self._pages(layer, block, hf, cell.indexer_mxfp4)
        return Outcome(main.get_name(), layer.kv_cache_dtype, block, tuple(sorted(pages.items())),
                       _per_token(pages, block, hf), self._drafts(hf))

    def _indexer_fp4(self, requested: bool) -> bool:
        """``dsa_indexer_uses_fp4`` of the wheel (its ROCm branch: CDNA 3 on gfx942, 4 on
        gfx950 as ``platforms/rocm.py`` maps them; aiter enabled)."""
        node = module_function(self.version, INDEXER, "dsa_indexer_uses_fp4")
        ns = {"current_platform": self.platform,
              "DSA_INDEXER_KV_DTYPES": module_constant(self.version, INDEXER,
                                                       "DSA_INDEXER_KV_DTYPES")}
        fn = function(node, ns)  # type: ignore[arg-type]  # may be None; present in every V4.1 release
        kv = "mxfp4" if requested else "fp8"
        cfg = SimpleNamespace(
            attention_config=SimpleNamespace(resolve_indexer_kv_dtype=lambda default: kv),
            model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="deepseek_v41")))
        cdna = {"gfx942": 3, "gfx950": 4}.get(self.gpu)
        with _patched_import({
                "vllm._aiter_ops": {"rocm_aiter_ops": SimpleNamespace(is_enabled=lambda: True)},
                "vllm.platforms.rocm": {"get_cdna_version": lambda: cdna}}):
            return bool(fn(cfg))

    def _init_checks(self, cls: str, hf: Mapping[str, Any], tp: int) -> None:
        """The topology refusals of the class's own ``__init__`` (mega: heads per group)."""
        code = init_checks(self.version, cls)
        if code is None:
            return
        layer = SimpleNamespace(n_local_heads=int(hf["num_attention_heads"]) // tp,
                                n_local_groups=int(hf["o_groups"]) // tp, prefix="layers.0")
        ns = {"self": layer, "WV_GROUP_SIZE": module_constant(
            self.version, FUSED_LAYOUT, "WV_GROUP_SIZE")}
        exec(code, ns)

    def _record(self, cls: str, requested: str) -> SimpleNamespace:
        """The wheel's ``__init__`` statements from the resolver call to the record."""
        flag = lookup(self.version, cls, "use_fp8_ds_mla_layout")
        packed = bool(ast.literal_eval(flag.value)) if flag is not None else True  # type: ignore[attr-defined]  # lookup returns ast.AST; the flag is an assignment
        pref = lookup(self.version, cls, "packed_kv_cache_dtype")
        preferred = function(pref, {})(None) if pref is not None else "fp8_ds_mla"
        layer = SimpleNamespace(_uses_fp8_ds_mla_layout=lambda: packed,
                                packed_kv_cache_dtype=preferred)
        ns = {"self": layer, "cache_config": SimpleNamespace(cache_dtype=requested),
              "_resolve_dsv4_kv_cache_dtype": self.resolver,
              "_use_v41_mxfp8_kv_record": self.mxfp8}
        exec(record_code(self.version), ns)
        layer.packed = packed
        layer.cache_config = ns["cache_config"]
        return layer

    def _block(self, backends: list[Backend], user: int | None) -> int:
        if user is not None:
            bad = [b.get_name() for b in backends if not b.supports_block_size(user)]
            if bad:
                raise Refused(f"block_size={user} not supported by {bad}")
            return user
        node = lookup_interface_opt(self.version, "_preferred_block_size_for_backends")
        if node is None:  # 0.30: the first non-SSM backend decides
            return backends[0].get_preferred_block_size(self.default_block)
        fn = _preferred_function(self.version)
        with _patched_import({"vllm.config.vllm": {"set_current_vllm_config": _no_config},
                              "vllm.v1.attention.backend": {"MultipleOf": MultipleOf}}):
            return int(fn(None, backends, self.default_block, None))

    def _pages(self, layer: SimpleNamespace, block: int, hf: Mapping[str, Any],
               mxfp4: bool) -> dict[str, int]:
        """Main and indexer pages per compress ratio: the wheels' spec arguments, padded."""
        main = main_spec(self.version, layer, block)
        row = self.indexer_head(int(hf["index_head_dim"]), mxfp4)
        index = indexer_spec(self.version, layer, block, row, self.mxfp8)
        pages: dict[str, int] = {}
        for ratio in sorted({int(r) for r in hf["compress_ratios"][: hf["num_hidden_layers"]]
                             if int(r) > 0}):
            states = block // ratio
            per_state = main["state_content_bytes"] or (
                512 * (1 if "float8" in str(main["dtype"]) else 2))
            pages[f"main c{ratio}"] = _round_up(states * per_state, main["alignment"])
            pages[f"indexer c{ratio}"] = _round_up(states * row, index["alignment"])
        return pages

    def _drafts(self, hf: Mapping[str, Any]) -> int:
        code = dspark_code(self.version)
        if code is None:
            return -1
        ns = {"self": SimpleNamespace(), "config": SimpleNamespace(**hf)}
        exec(code, ns)
        return int(ns["self"].num_dspark_layers)


@dataclass(frozen=True)
class Cell:
    """One setup of the matrix (the engine config side)."""

    tp: int = 1
    block_size: int | None = None
    kv_cache_dtype: str = "auto"
    lora: bool = False
    backend: str | None = None
    indexer_mxfp4: bool = False


def _round_up(value: int, multiple: int | None) -> int:
    return value if not multiple else -(-value // multiple) * multiple


def _per_token(pages: dict[str, int], block: int, hf: Mapping[str, Any]) -> float:
    """Growth per context token over the KV-source layers (index sources add their rows)."""
    n = int(hf["num_hidden_layers"])
    ratios = [int(r) for r in hf["compress_ratios"][:n]]
    total = 0.0
    for i in hf.get("kv_source_layer_ids") or ():
        if i < n and ratios[i] > 0:
            total += pages[f"main c{ratios[i]}"] / block
            if i in (hf.get("index_source_layer_ids") or ()):
                total += pages[f"indexer c{ratios[i]}"] / block
    return total


def _no_config(cfg: Any) -> Any:
    return contextlib.nullcontext()


@cache
def _preferred_function(version: str) -> Callable[..., Any]:
    node = lookup_interface_opt(version, "_preferred_block_size_for_backends")
    return function(node, {"math": math, "itertools": itertools})  # type: ignore[arg-type]  # may be None; called only for releases that have it


@cache
def _torch() -> Any:
    import torch

    return torch


def _cache_default_block(version: str) -> int:
    tree = ast.parse(rs.source(version, CACHE))
    cls = rs._find(tree, ast.ClassDef, "CacheConfig")
    stmt = member(cls, "DEFAULT_BLOCK_SIZE")
    return int(ast.literal_eval(stmt.value))  # type: ignore[union-attr]  # _member may return None; every release defines it


@cache
def lookup_interface_opt(version: str, name: str) -> ast.FunctionDef | None:
    cls = rs._find(ast.parse(rs.source(version, INTERFACE)), ast.ClassDef, "Platform")
    node = member(cls, name)
    return node if isinstance(node, ast.FunctionDef) else None


@contextlib.contextmanager
def _patched_import(modules: dict[str, dict[str, Any]]):
    """Function-local ``from vllm... import X`` inside a cut function, answered by stand-ins."""
    import builtins

    real = builtins.__import__

    def fake(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (),
             level: int = 0) -> Any:
        if name in modules:
            return SimpleNamespace(**modules[name])
        return real(name, globals, locals, fromlist, level)

    builtins.__import__ = fake
    try:
        yield
    finally:
        builtins.__import__ = real


REGISTRY = "vllm/v1/attention/backends/registry.py"


@cache
def registry_names(version: str) -> tuple[str, ...]:
    """The members of the release's ``AttentionBackendEnum`` (what a config may name)."""
    cls = rs._find(ast.parse(rs.source(version, REGISTRY)), ast.ClassDef, "AttentionBackendEnum")
    return tuple(ast.unparse(s.targets[0]) for s in cls.body
                 if isinstance(s, ast.Assign) and len(s.targets) == 1)


@cache
def dspark_code(version: str) -> Any:
    """``self.num_dspark_layers = ...`` of the DSpark draft model (None: no such file)."""
    if not rs.has_file(version, DSPARK):
        return None
    cls = rs._find(ast.parse(rs.source(version, DSPARK)), ast.ClassDef, "DSparkDeepseekV4Model")
    stmt = next(s for s in ast.walk(cls) if isinstance(s, ast.Assign)
                and ast.unparse(s.targets[0]) == "self.num_dspark_layers")
    return compile(ast.Module(body=[stmt], type_ignores=[]), "<dspark>", "exec")


@cache
def init_checks(version: str, cls: str) -> Any:
    """The ``if self.n_local_heads ...: raise`` statements of the class's own ``__init__``."""
    node = classes(version).get(cls)
    init = member(node, "__init__") if node is not None else None
    if init is None:
        return None
    checks: list[ast.stmt] = [s for s in init.body if isinstance(s, ast.If)  # type: ignore[attr-defined]  # _member returns ast.AST; __init__ is a FunctionDef
              and "n_local_heads" in ast.unparse(s.test)
              and any(isinstance(n, ast.Raise) for n in ast.walk(s))]
    return compile(ast.Module(body=checks, type_ignores=[]), "<init>", "exec") if checks else None


@cache
def record_code(version: str) -> Any:
    return compile(ast.Module(body=record_statements(version), type_ignores=[]), "<record>",
                   "exec")


@cache
def record_statements(version: str) -> list[ast.stmt]:
    """``DeepseekV4Attention.__init__``: the resolver call through the record/alignment
    (and the nvfp4 refusal right after, where the release has it)."""
    cls = rs._find(ast.parse(rs.source(version, ATTN)), ast.ClassDef, "DeepseekV4Attention")
    init = member(cls, "__init__")
    body = init.body  # type: ignore[union-attr]  # _member may return None; every release defines __init__
    start = next(i for i, s in enumerate(body) if "_resolve_dsv4_kv_cache_dtype" in ast.unparse(s)
                 and isinstance(s, ast.Assign))
    stop = next(i for i, s in enumerate(body) if isinstance(s, ast.Assign)
                and ast.unparse(s.targets[0]) == "self.kv_page_alignment")
    if stop + 1 < len(body) and isinstance(body[stop + 1], ast.If) and \
            "nvfp4_ds_mla" in ast.unparse(body[stop + 1].test):
        stop += 1
    return body[start: stop + 1]


@cache
def _spec_function(version: str, cls: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    ns: dict[str, Any] = {"MLAAttentionSpec": dict, "torch": _torch(), "math": math,
                          "get_kv_quant_mode": lambda dtype: None}
    return function(lookup(version, cls, "get_kv_cache_spec"), ns), ns  # type: ignore[arg-type]  # lookup may return None; every spec class defines it


def _spec_call(version: str, cls: str, layer: Any, cache_dtype: str, block: int,
               extra: dict[str, Any]) -> dict[str, Any]:
    """The spec class's arguments (``MLAAttentionSpec`` stands in as ``dict``)."""
    fn, ns = _spec_function(version, cls)
    ns.update(extra)
    cfg = SimpleNamespace(cache_config=SimpleNamespace(block_size=block, cache_dtype=cache_dtype),
                          attention_config=SimpleNamespace(indexer_sparse_logits=False))
    captured = dict(fn(layer, cfg))
    captured.setdefault("state_content_bytes", None)
    captured.setdefault("alignment", None)
    return captured


def main_spec(version: str, layer: SimpleNamespace, block: int) -> dict[str, Any]:
    """The main (compressed) cache's spec arguments of a KV-source layer."""
    me = SimpleNamespace(**vars(layer), is_kv_source=True, head_dim=512, compress_ratio=4)
    for attr in ("swa_bytes_per_token", "kv_bytes_per_token"):
        if hasattr(me, attr) and not hasattr(me, "compressed_bytes_per_token"):
            me.compressed_bytes_per_token = getattr(me, attr)
    return _spec_call(version, "DeepseekV4Attention", me, layer.kv_cache_dtype, block,
                      {"_use_v41_mxfp8_kv_record": lambda: False})


def indexer_spec(version: str, layer: SimpleNamespace, block: int, row: int,
                 mxfp8: Callable[[], bool]) -> dict[str, Any]:
    me = SimpleNamespace(cache_config=SimpleNamespace(block_size=block),
                         head_dim=row, dtype=_torch().uint8, compress_ratio=4,
                         sparse_logits=False, rocm_mxfp4=False)
    return _spec_call(version, "DeepseekV4IndexerCache", me,
                      layer.cache_config.cache_dtype, block, {"_use_v41_mxfp8_kv_record": mxfp8})


@cache
def release(version: str, gpu: str) -> Release:
    return Release(version, gpu)
