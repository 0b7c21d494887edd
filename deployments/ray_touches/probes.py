"""What a Ray touch is (``RayTouch``) and the probes that check one in the installed Ray.

A probe reads the installed Ray without side effects and returns None when the internal
is there as used, else what is missing. Each builder returns a plain named function.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace

Probe = Callable[[], "str | None"]  # None = present as used; else what is missing
AFFECTED = "Ray 2.60.0 (checked; other releases are probed, not assumed)"


@dataclass(frozen=True)
class RayTouch:
    """One use of a Ray internal, documented like a vLLM patch."""

    name: str
    target: str  # the internal symbol (module:attribute or a parameter)
    used_in: tuple[str, ...]  # call sites, "module:qualname" (tests resolve each)
    why: str
    how: str
    upstream: str
    removal: str
    probe: Probe
    required: bool = True  # a missing required touch refuses build_app
    affected: str = AFFECTED
    pd_only: bool = False  # used by the P/D app only: refuses only a P/D build
    # Probing imports Ray Serve LLM's server (vLLM, torch): required where that is
    # imported anyway (a replica, Ray Serve LLM's builders), not by a light build.
    loads_llm: bool = False


def optional(*touches: RayTouch) -> tuple[RayTouch, ...]:
    """``touches`` that never refuse a build (``required=False``): the code that uses one
    asks ``present(name)`` and does without it, logged."""
    return tuple(replace(t, required=False) for t in touches)


SERVE_CONSTANTS = "ray.serve._private.constants"
# When the touches that find a deployment's replicas and count their requests can go.
PER_REPLICA_COUNTS = "when serve.status() reports ongoing requests per replica"


def private_keyword(name: str, module: str, func: str, param: str, *,
                    used_in: tuple[str, ...], why: str, how: str, removal: str) -> RayTouch:
    """A touch of an underscore keyword of a public Ray function: its target, upstream
    state and probe follow from where the keyword is."""
    return RayTouch(name=name, target=f"{module}:{func}({param}=)", used_in=used_in, why=why,
                    how=how, upstream=f"underscore keyword of the public {module}.{func}",
                    removal=removal, probe=parameter(module, func, param))


def per_replica(name: str, module: str, *attrs: str, used_in: tuple[str, ...], why: str,
                how: str, upstream: str) -> RayTouch:
    """A touch that finds or counts a deployment's replicas one by one: it goes when Serve
    reports ongoing requests per replica; target and probe follow from the attributes."""
    return RayTouch(name=name, target=f"{module}:{', '.join(attrs)}", used_in=used_in,
                    why=why, how=how, upstream=upstream, removal=PER_REPLICA_COUNTS,
                    probe=attr_chain(module, *attrs))


def serve_env(name: str, *constants: str, used_in: tuple[str, ...], why: str, how: str,
              removal: str) -> RayTouch:
    """A touch of Serve settings its ``constants.py`` reads from the environment, outside
    Serve's documented settings: target, upstream state and probe follow from the names."""
    return RayTouch(name=name, target=f"{SERVE_CONSTANTS}: {', '.join(constants)}",
                    used_in=used_in, why=why, how=how,
                    upstream="environment variables read in Serve's constants.py, not in its "
                             "documented settings",
                    removal=removal, probe=symbols(SERVE_CONSTANTS, *constants))


def symbols(module: str, *names: str) -> Probe:
    """A probe: ``module`` imports and has every one of ``names``."""
    def probe() -> str | None:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            return f"cannot import {module}: {exc}"
        missing = [n for n in names if not hasattr(mod, n)]
        return f"{module} lacks {', '.join(missing)}" if missing else None
    return probe


def resolve(module: str, path: str) -> tuple[object | None, str | None]:
    """(``module.path``, None), or (None, what is missing)."""
    try:
        obj: object = importlib.import_module(module)
    except ImportError as exc:
        return None, f"cannot import {module}: {exc}"
    for part in path.split("."):
        if not hasattr(obj, part):
            return None, f"{module}.{path} does not exist ({part!r} missing)"
        obj = getattr(obj, part)
    return obj, None


def attr_chain(module: str, *paths: str) -> Probe:
    """A probe: every one of ``module.path`` (dotted attributes) exists."""
    def probe() -> str | None:
        return next((missing for path in paths
                     if (missing := resolve(module, path)[1]) is not None), None)
    return probe


def every(*probes: Probe) -> Probe:
    """A probe: the first of ``probes`` that finds something missing, else None."""
    def probe() -> str | None:
        return next((missing for p in probes if (missing := p()) is not None), None)
    return probe


def on_target(module: str, path: str, check: Callable[[object], str | None]) -> Probe:
    """A probe: ``module.path`` resolves and ``check`` finds nothing missing in it."""
    def probe() -> str | None:
        obj, missing = resolve(module, path)
        if missing:
            return missing
        return check(obj)
    return probe


def dataclass_field(module: str, path: str, field: str) -> Probe:
    """A probe: the dataclass ``module.path`` declares ``field``."""
    def check(obj: object) -> str | None:
        fields = getattr(obj, "__dataclass_fields__", {})
        return None if field in fields else f"{module}.{path} has no field {field!r}"
    return on_target(module, path, check)


def call_site_problem(site: str) -> str | None:
    """None when ``site`` ("package.module:Qual.name") imports and resolves; else why not."""
    module, sep, path = site.partition(":")
    if not sep or not path:
        return f"{site!r} is not 'module:qualname' (e.g. 'deployments.local.drain:drain')"
    return resolve(module, path)[1]


def called_by(module: str, func: str, caller: str) -> Probe:
    """A probe: ``module`` has the function ``func`` and ``caller`` (in the same module)
    still calls it by that module-level name, the name a replacement must take."""
    return every(symbols(module, func), source_mentions(module, caller, f"{func}("))


def source_mentions(module: str, path: str, *texts: str) -> Probe:
    """A probe: the source of ``module.path`` contains every one of ``texts`` (behaviours
    we rely on)."""
    def check(obj: object) -> str | None:
        try:
            source = inspect.getsource(obj)  # type: ignore[arg-type]  # getsource raises TypeError on a non-source object
        except (OSError, TypeError) as exc:
            return f"cannot read the source of {module}.{path}: {exc}"
        gone = next((t for t in texts if t not in source), None)
        return None if gone is None else f"{module}.{path} no longer does {gone!r}"
    return on_target(module, path, check)


def parameter(module: str, path: str, param: str) -> Probe:
    """A probe: the callable ``module.path`` takes keyword ``param`` (or pops it from kwargs)."""
    def check(obj: object) -> str | None:
        func = inspect.unwrap(obj)  # type: ignore[arg-type]  # the target is a callable
        if param in inspect.signature(func).parameters:
            return None
        return None if f'"{param}"' in inspect.getsource(func) else \
            f"{module}.{path} does not take {param}"
    return on_target(module, path, check)


def text_mentions(module: str, attr: str, *texts: str) -> Probe:
    """A probe: the string constant ``module.attr`` (a template) contains every one of
    ``texts``."""
    def check(obj: object) -> str | None:
        if not isinstance(obj, str):
            return f"{module}.{attr} is not a string"
        absent = [t for t in texts if t not in obj]
        return f"{module}.{attr} no longer has {absent!r}" if absent else None
    return on_target(module, attr, check)


# Ray says whether usage stats are on: the quiet local head and the telemetry push both act
# only when they are off.
USAGE_STATS_SWITCH = symbols("ray._common.usage.usage_lib", "usage_stats_enabled")
