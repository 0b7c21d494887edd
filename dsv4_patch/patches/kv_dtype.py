"""The KV-cache-dtype patches: the resolver (0.23-0.29) and the layer's inline assert
(0.20-0.22).
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

from dsv4_patch import rules
from dsv4_patch.patch import ORIGINAL, Patch, PatchError, Verdict, mark, original_of, rebind

logger = logging.getLogger("dsv4_patch")

PATCHED_MARK = ORIGINAL  # on our replacements: the vLLM object they replaced


# ------------------------------------------------------------------ resolver

RESOLVER_MODULE = "vllm.models.deepseek_v4.attention"
RESOLVER_NAME = "_resolve_dsv4_kv_cache_dtype"


@dataclass(frozen=True)
class Outcome:
    """What one resolver call did: return value, ``cache_config`` afterwards, or the error."""

    cache_dtype_str: str | None
    torch_dtype: str | None
    cache_config_after: Any
    error: str | None

    def same_decision(self, decision: rules.UpstreamDecision, before: Any) -> bool:
        """Equal to upstream's decision: result, torch dtype, write-back, error or not."""
        if (self.error is None) != (decision.error is None):
            return False
        if self.error is not None:
            return True
        after = before if decision.write_back is None else decision.write_back
        return (self.cache_dtype_str, self.torch_dtype, self.cache_config_after) == (
            decision.cache_dtype_str, decision.torch_dtype, after)


def call_resolver(resolver: Callable[..., Any], layout: bool, value: Any) -> Outcome:
    """Call ``resolver(layout, value, cache_config)`` like a layer does; catch its decision.

    The cache config is a plain object holding ``cache_dtype`` = ``value`` (the resolver
    only reads and writes that attribute), so any input, garbage included, can be tried.
    """
    config = SimpleNamespace(cache_dtype=value)
    try:
        cache_dtype_str, dtype = resolver(layout, value, config)
    except Exception as exc:  # the resolver's decision is "error"; which one is recorded
        return Outcome(None, None, config.cache_dtype, f"{type(exc).__name__}: {exc}")
    return Outcome(cache_dtype_str, str(dtype).removeprefix("torch."), config.cache_dtype, None)


def resolver_mismatches(
    resolver: Callable[..., Any], layouts: tuple[bool, ...] = (True,)
) -> list[str]:
    """Inputs (of ``rules.PROBE_DTYPES``) where ``resolver`` decides unlike upstream 0.30+."""
    found = []
    for layout in layouts:
        for value in rules.PROBE_DTYPES:
            outcome = call_resolver(resolver, layout, value)
            decision = rules.upstream_resolver_decision(layout, value)
            if not outcome.same_decision(decision, value):
                got = outcome.error or f"{outcome.cache_dtype_str}/{outcome.torch_dtype}"
                want = "an error" if decision.error else decision.cache_dtype_str
                where = "" if layout else " (plain rows)"
                found.append(f"{value!r}{where}: {got}, upstream {want}")
    return found


def probe_resolver(resolver: Callable[..., Any]) -> str | None:
    """None when ``resolver`` decides like upstream 0.30+ on fp8_ds_mla, else the differences."""
    mismatches = resolver_mismatches(resolver)
    return "; ".join(mismatches) if mismatches else None


def _probe_resolver_module(module: ModuleType) -> Verdict:
    resolver = original_of(getattr(module, RESOLVER_NAME, None))
    if resolver is None:
        return Verdict(False, f"{module.__name__}.{RESOLVER_NAME} not in this vLLM")
    try:
        inspect.signature(resolver).bind(True, "auto", None)
    except TypeError as exc:
        return Verdict(None, f"{RESOLVER_NAME}{inspect.signature(resolver)} does not take "
                       f"(layout, kv_cache_dtype, cache_config): {exc}")
    failure = probe_resolver(resolver)
    if failure is None:
        return Verdict(False, "installed resolver decides like upstream 0.30+ on "
                       f"{len(rules.PROBE_DTYPES)} inputs (auto -> fp8_ds_mla)")
    return Verdict(True, f"probe failed ({failure})")


def make_resolver(original: Callable[..., Any]) -> Callable[..., Any]:
    """Build the replacement resolver around ``original``.

    fp8_ds_mla layout: decided by ``rules.upstream_resolver_decision`` (the fixed
    upstream resolver, input for input), with its ``cache_config`` write-back so the
    page specs pick the 576 B slot; a refusal raises KVCacheDtypeError naming the fix.
    Plain rows: the installed vLLM's own code, unchanged (same in every release).
    """
    import torch  # vLLM is importing us from its attention module: torch is loaded.

    @functools.wraps(original)
    def resolve(
        use_fp8_ds_mla_layout: bool, kv_cache_dtype: str, cache_config: Any = None, *args: Any
    ) -> tuple[str, Any]:
        if not use_fp8_ds_mla_layout:
            return original(use_fp8_ds_mla_layout, kv_cache_dtype, cache_config, *args)
        decision = rules.upstream_resolver_decision(True, kv_cache_dtype)
        if decision.error is not None:
            raise rules.KVCacheDtypeError(decision.error)
        if decision.write_back is not None and cache_config is not None:
            _write_back(cache_config, kv_cache_dtype, decision.write_back)
        return str(decision.cache_dtype_str), getattr(torch, str(decision.torch_dtype))

    return mark(resolve, original)


def _write_back(cache_config: Any, requested: Any, value: str) -> None:
    if cache_config.cache_dtype != value:
        logger.info("dsv4_patch: kv_cache_dtype=%s on the fp8_ds_mla layout resolves to %s "
                    "(written back to cache_config)", requested, value)
    cache_config.cache_dtype = value


def _patch_resolver(module: ModuleType) -> str:
    original = getattr(module, RESOLVER_NAME)
    replacement = make_resolver(original)
    setattr(module, RESOLVER_NAME, replacement)
    sites = [f"{module.__name__}.{RESOLVER_NAME}"]
    sites += rebind(original, replacement, "vllm.models.deepseek_v4")
    return f"replaced {', '.join(sorted(set(sites)))}"


RESOLVER_PATCH = Patch(
    name="dsv4.resolve_kv_cache_dtype",
    module=RESOLVER_MODULE,
    target=f"{RESOLVER_MODULE}.{RESOLVER_NAME}",
    why=(
        "vLLM 0.23-0.29 assert kv_cache_dtype.startswith('fp8') in this resolver on the "
        "fp8_ds_mla layout, so the default kv_cache_dtype='auto' crashes DeepSeek-V4 at layer "
        "construction (and under python -O every value, bfloat16 too, becomes fp8_ds_mla)."
    ),
    how=(
        "Post-import hook on the attention module; probe the resolver on 11 inputs against "
        "the fixed upstream decision (rules.upstream_resolver_decision); where any differs, "
        "rebind the name (and every copy under vllm.models.deepseek_v4) to a wrapper that "
        "decides fp8_ds_mla like upstream 0.30+ (auto and every fp8* -> fp8_ds_mla with "
        "cache_config write-back, anything else refused with a clear error) and delegates "
        "plain rows to the original."
    ),
    upstream="vllm-project/vllm#47174 (bug), #45091 (fix), #55134 (duplicate fix, seed)",
    affected=(
        "vLLM 0.23.0-0.29.x (the resolver asserts; 0.20.0-0.22.x have no resolver: see "
        "dsv4.layer_init_kv_cache_dtype) and any later commit where the probe fails"
    ),
    remove_when="the oldest supported vLLM (Ray Serve LLM's pin) is >= 0.30",
    probe=_probe_resolver_module,
    change=_patch_resolver,
)


# ----------------------------------------------- layer __init__ (0.20.0-0.22.x)

LAYER_CLASS = "DeepseekV4MLAAttention"
LEGACY_LAYER_MODULE = "vllm.model_executor.layers.deepseek_v4_attention"


def inline_fp8_assert_line(function: Callable[..., Any]) -> int | None:
    """Line (in its file) of an ``assert <x>.startswith("fp8")`` in ``function``, or None.

    Read from the source, not from running it: the layer ``__init__`` needs a whole
    vLLM config and CUDA events, and under ``python -O`` the assert is compiled out
    while the unconverted dtype still reaches the KV specs.
    """
    source = textwrap.dedent(inspect.getsource(function))
    first = inspect.getsourcelines(function)[1]
    for node in ast.walk(ast.parse(source)):
        test = node.test if isinstance(node, ast.Assert) else None
        if (isinstance(node, ast.Assert) and isinstance(test, ast.Call)
                and isinstance(test.func, ast.Attribute)
                and test.func.attr == "startswith" and test.args
                and isinstance(test.args[0], ast.Constant) and test.args[0].value == "fp8"):
            return first + node.lineno - 1
    return None


def _probe_layer(module: ModuleType) -> Verdict:
    cls = getattr(module, LAYER_CLASS, None)
    if cls is None:
        return Verdict(False, f"{module.__name__}.{LAYER_CLASS} not in this vLLM")
    line = inline_fp8_assert_line(original_of(vars(cls).get("__init__", cls.__init__)))
    if line is None:
        return Verdict(False, f"{LAYER_CLASS}.__init__ has no inline fp8 assert (this vLLM "
                       f"decides in {RESOLVER_NAME})")
    return Verdict(True, f"{LAYER_CLASS}.__init__ asserts kv_cache_dtype.startswith('fp8') "
                   f"inline (line {line}), so auto fails")


def resolve_cache_config(cache_config: Any) -> None:
    """Decide ``cache_config.cache_dtype`` like upstream 0.30+ before the inline assert runs.

    fp8_ds_mla is the only layout of the 0.20-0.22 layer (FlashMLA / ROCm Aiter). A value
    upstream refuses raises KVCacheDtypeError here (it would otherwise hit the assert, or
    under ``python -O`` slip through unconverted); one it accepts becomes ``fp8_ds_mla``,
    which the layer's own code then keeps, as upstream writes it back.
    """
    requested = cache_config.cache_dtype
    decision = rules.upstream_resolver_decision(True, requested)
    if decision.error is not None:
        raise rules.KVCacheDtypeError(decision.error)
    if decision.write_back is not None:
        _write_back(cache_config, requested, decision.write_back)


def _patch_layer(module: ModuleType) -> str:
    cls = getattr(module, LAYER_CLASS)
    original = vars(cls)["__init__"]
    signature = inspect.signature(original)
    if "cache_config" not in signature.parameters:
        raise PatchError(
            f"{module.__name__}.{LAYER_CLASS}.__init__{signature} asserts an fp8 kv cache "
            "dtype but takes no cache_config, so dsv4_patch cannot decide it before the "
            "assert. Fix: set kv_cache_dtype: fp8, or update dsv4_patch for this vLLM.")

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        cache_config = signature.bind(self, *args, **kwargs).arguments.get("cache_config")
        if cache_config is not None:
            resolve_cache_config(cache_config)
        original(self, *args, **kwargs)

    cls.__init__ = mark(__init__, original)
    return f"{module.__name__}.{LAYER_CLASS}.__init__ decides cache_config.cache_dtype first"


LAYER_PATCH = Patch(
    name="dsv4.layer_init_kv_cache_dtype",
    module=RESOLVER_MODULE,
    also=(LEGACY_LAYER_MODULE,),
    target=f"{RESOLVER_MODULE}.{LAYER_CLASS}.__init__ (0.20-0.21: {LEGACY_LAYER_MODULE})",
    why=(
        "vLLM 0.20.0-0.22.x have no resolver: DeepseekV4MLAAttention.__init__ reads "
        "cache_config.cache_dtype and asserts it starts with 'fp8', so kv_cache_dtype='auto' "
        "crashes at layer construction under plain `vllm serve` / LLM(...)."
    ),
    how=(
        "Post-import hook on the layer module; probe the __init__ source for the inline "
        "assert; where present, wrap __init__ so the worker's cache_config.cache_dtype is "
        "decided like upstream 0.30+ before the original runs (auto/fp8* -> fp8_ds_mla, "
        "written back; anything else refused with a clear error)."
    ),
    upstream="vllm-project/vllm#47174 (bug), #45091 (fix, moved the decision into a resolver)",
    affected="vLLM 0.20.0-0.22.1 (inline assert in the layer __init__)",
    remove_when="the oldest supported vLLM is >= 0.23 (then the resolver patch covers it)",
    probe=_probe_layer,
    change=_patch_layer,
)
