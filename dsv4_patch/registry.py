"""The registry: every ``patch.Patch`` dsv4_patch may apply, in install order.

The plugin installs all of them (``patch.install``) and ``dsv4-serve doctor`` probes all
of them, through the same loop; nothing else special-cases a patch. Each module that
defines patches owns its documentation: ``patches`` (kv cache dtype on 0.20-0.29, the
SM120 validator, the engine's lifetime), ``cpu_compat`` (Triton launchers and one CPU
builder bug), ``cpu_ops`` (the DeepSeek-V4 CPU ops); the CPU ones sit behind
``cpu_gate``.

``all_reads`` lists the vLLM internals dsv4_patch only reads or calls (``patch.Read``:
the same documentation fields, a probe, never a change); the doctor shows them too.
"""

from __future__ import annotations

from dsv4_patch.patch import Patch, Read


def all_patches() -> tuple[Patch, ...]:
    """Every patch. Imported on demand: the CPU modules load torch (a vLLM process has it)."""
    from dsv4_patch import cpu_compat, cpu_ops, patches

    return (*patches.PATCHES, *cpu_compat.PATCHES, *cpu_ops.PATCHES)


def all_reads() -> tuple[Read, ...]:
    """Every read of vLLM internals (the layout selector, the NIXL connector's facts)."""
    from dsv4_patch import selector, worker_ext

    return (selector.READ, worker_ext.CONNECTOR_READ)
