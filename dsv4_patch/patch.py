"""The one mechanism behind every touch dsv4_patch makes to vLLM (and torch) internals.

A ``Patch`` documents itself (target, why, how, upstream, affected releases, removal
condition, in the style of ``vllm_ascend/patch/__init__.py``) and brings two functions:
``probe(module)`` decides whether the loaded code needs it, ``change(module)`` applies
it and says what it changed. ``Patch.apply(module)`` runs the two and returns the
``PatchResult``; ``install(record, patches)`` owns the rest, for every patch alike:

- hooks: a patch is applied when vLLM itself imports its target module (post-import
  hook, ``import_hooks``), so processes that never build DeepSeek-V4 pay nothing; the
  record shows ``pending`` until then, ``skipped`` at once when the release has none of
  the patch's modules;
- gates: a patch may name a ``gate`` (e.g. the CPU platform with DeepSeek-V4's CPU path,
  ``cpu_gate``), evaluated once per ``install`` call; a closed gate records ``skipped``
  with its reason for every patch behind it;
- idempotence: the applied result is kept on the target module (``APPLIED``), so a
  second ``apply`` of the same patch to the same module returns that result and
  changes nothing;
- recording: every result goes into the ``PatchRecord`` (pending -> final).

Safety: a probe that cannot run on a release (missing symbol, another signature) is
recorded ``error`` with the reason and the target left alone; it never raises out of
vLLM's import. Only ``PatchError`` propagates: a patch that is needed but cannot be
applied safely (a DeepSeek-V4 that would crash later, or a setting that is wrong) must
fail loudly.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from dsv4_patch.import_hooks import module_exists, when_imported
from dsv4_patch.record import PatchRecord, PatchResult

logger = logging.getLogger("dsv4_patch")

ORIGINAL = "__dsv4_patch__"  # on a replacement: the vLLM object it replaced
APPLIED = "__dsv4_applied__"  # on a target module: {patch name: applied PatchResult}

Gate = Callable[[], "str | None"]


class PatchError(RuntimeError):
    """A patch is needed on this vLLM but cannot be applied safely."""


@dataclass(frozen=True)
class Verdict:
    """What a probe found: ``needed`` True/False, or None when it could not run here."""

    needed: bool | None
    reason: str


@dataclass(frozen=True)
class Documented:
    """What every touch of vLLM internals says of itself (a ``Patch`` or a ``Read``)."""

    name: str
    module: str
    target: str
    why: str
    how: str
    upstream: str
    affected: str
    remove_when: str


@dataclass(frozen=True)
class Patch(Documented):
    """One documented patch: where, why, how, until when; its probe and its change.

    ``module`` is the target module; ``also`` older releases' paths of the same code
    (the first that exists in the installed vLLM is hooked). ``gate`` returns why the
    patch does not apply in this process at all (None: it may), e.g. off the CPU.
    """

    probe: Callable[[ModuleType], Verdict]
    change: Callable[[ModuleType], str]
    also: tuple[str, ...] = ()
    gate: Gate | None = None

    @property
    def modules(self) -> tuple[str, ...]:
        return (self.module, *self.also)

    def apply(self, module: ModuleType) -> PatchResult:
        """Probe, then change where needed; once per module (see the module doc)."""
        done: dict[str, PatchResult] = vars(module).setdefault(APPLIED, {})
        if self.name in done:
            return done[self.name]
        try:
            verdict = self.probe(module)
        except PatchError:
            raise
        except Exception as exc:  # recorded, with the target left unchanged (module doc)
            logger.warning("dsv4_patch: %s: probe failed: %r", self.name, exc)
            return PatchResult(self.name, "error", f"probe could not run on this vLLM "
                               f"({type(exc).__name__}: {exc}); {self.target} left unchanged")
        if verdict.needed is None:
            return PatchResult(self.name, "error", f"{verdict.reason}; {self.target} left "
                               "unchanged")
        if not verdict.needed:
            return PatchResult(self.name, "skipped", verdict.reason)
        result = PatchResult(self.name, "applied", f"{verdict.reason}; {self.change(module)}")
        done[self.name] = result
        return result


@dataclass(frozen=True)
class Read(Documented):
    """A vLLM internal dsv4_patch reads or calls but never changes, documented like a patch.

    ``probe()`` says what the installed vLLM lacks (None: present as used); code that
    reads the internal falls back (said in ``how``) when it is missing, and
    ``dsv4-serve doctor`` lists every read with its probe.
    """

    probe: Callable[[], str | None]


def original_of(obj: Any) -> Any:
    """The vLLM object behind one of our replacements (or ``obj`` itself)."""
    return getattr(obj, ORIGINAL, obj)


def mark(replacement: Any, original: Any) -> Any:
    """Record on ``replacement`` which vLLM object it replaces (read by ``original_of``)."""
    setattr(replacement, ORIGINAL, original)
    return replacement


def rebind(original: object, replacement: object, prefix: str = "vllm") -> list[str]:
    """Point every loaded module under ``prefix`` that holds ``original`` at ``replacement``.

    Catches the ``from x import y`` copies vLLM modules made before the patch ran.
    Returns the rebound ``module.attr`` names.
    """
    rebound = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == prefix or name.startswith(prefix + ".")):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)
                rebound.append(f"{name}.{attr}")
    return rebound


def install(record: PatchRecord, patches: tuple[Patch, ...]) -> list[PatchResult]:
    """Hook, gate and record every patch of ``patches``; return their results now.

    Idempotent per record: a patch the record already holds is not hooked again.
    Results that come later (at the import of a target module) replace the
    ``pending`` entry in ``record``. A ``PatchError`` propagates.
    """
    gates: dict[Gate, str | None] = {}
    results = []
    for spec in patches:
        known = record.result_of(spec.name)
        if known is None:
            known = _install_one(spec, record, gates)
            record.set(known)
        results.append(known)
    return results


def not_here(spec: Patch, gates: dict[Gate, str | None]) -> str | None:
    """Why ``spec`` has nothing to do in this process (closed gate, no target module), or
    None. ``gates`` caches each gate's answer: asked once per install (and per doctor run)."""
    if spec.gate is not None:
        if spec.gate not in gates:
            gates[spec.gate] = spec.gate()
        if gates[spec.gate] is not None:
            return gates[spec.gate]
    if not any(module_exists(name) for name in spec.modules):
        return f"no module {' or '.join(spec.modules)} in this vLLM"
    return None


def target_module(spec: Patch) -> str:
    """The module the patch hooks: the first of ``spec.modules`` this vLLM has."""
    return next(name for name in spec.modules if module_exists(name))


def _install_one(spec: Patch, record: PatchRecord,
                 gates: dict[Gate, str | None]) -> PatchResult:
    skip = not_here(spec, gates)
    if skip is not None:
        return PatchResult(spec.name, "skipped", skip)
    present = [target_module(spec)]
    if present[0] in sys.modules:
        return spec.apply(sys.modules[present[0]])
    when_imported(present[0], functools.partial(_apply_and_record, spec, record))
    return PatchResult(spec.name, "pending", f"waiting for import of {present[0]}")


def _apply_and_record(spec: Patch, record: PatchRecord, module: ModuleType) -> None:
    result = spec.apply(module)
    record.set(result)
    logger.info("dsv4_patch: %s %s: %s", spec.name, result.status, result.reason)
