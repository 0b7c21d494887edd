"""The index: every ``patch.Patch`` dsv4_patch may apply, in install order, and every read.

The plugin installs all of them (``patch.install``) and ``dsv4-serve doctor`` probes all
of them, through the same loop; nothing else special-cases a patch. One file per patch
under ``dsv4_patch/patches/``, each owning its documentation: ``kv_dtype`` (the resolver
and the layer's inline assert, 0.20-0.29), ``sm120`` (the SM120 validator),
``parent_watch`` (the engine's lifetime, ``lifetime``), and the CPU ones under
``patches/cpu/`` behind its ``gate``: ``fallbacks`` (Triton launchers and one CPU builder
bug), ``ops`` (the DeepSeek-V4 CPU ops).

``all_reads`` lists the vLLM internals dsv4_patch only reads or calls (``patch.Read``:
the same documentation fields, a probe, never a change); the doctor shows them too.
"""

from __future__ import annotations

from dsv4_patch.patch import Patch, Read


def general_patches() -> tuple[Patch, ...]:
    """The patches every platform gets: KV cache dtype, SM120 validator, engine lifetime."""
    from dsv4_patch.patches.kv_dtype import LAYER_PATCH, RESOLVER_PATCH
    from dsv4_patch.patches.parent_watch import PARENT_WATCH
    from dsv4_patch.patches.sm120 import SM120_PATCH

    return (RESOLVER_PATCH, LAYER_PATCH, SM120_PATCH, PARENT_WATCH)


def all_patches() -> tuple[Patch, ...]:
    """Every patch. Imported on demand: the CPU modules load torch (a vLLM process has it)."""
    from dsv4_patch.patches.cpu import fallbacks, ops

    return (*general_patches(), *fallbacks.PATCHES, *ops.PATCHES)


def all_reads() -> tuple[Read, ...]:
    """Every read of vLLM internals (the layout selector, the NIXL connector's facts), and
    the Responses state the replica moves into the fleet's store (``responses_touch``)."""
    from dsv4_patch import responses_touch, selector, worker_ext

    return (selector.READ, worker_ext.CONNECTOR_READ, responses_touch.READ)
