"""The ``vllm.general_plugins`` entry point: vLLM calls ``register()`` in every process.

vLLM loads general plugins in the API front-end, the engine core, every worker
and every Ray worker (``vllm.plugins.load_general_plugins``); inside Ray actors it
forces ``spawn``, so this is the only way a fix reaches the processes that build
DeepSeek-V4 layers. ``register`` is idempotent and cheap: it installs the whole
registry (``registry.all_patches``) with ``patch.install``, which only registers
post-import hooks: each patch waits for its target module (the CPU ops for the
DeepSeek-V4 model package), so a process serving another model never loads the
kernel library for them nor registers 16 torch ops it will not call.
Set ``VLLM_PLUGINS`` to a list that omits ``dsv4_patch`` to turn it off.
"""

from __future__ import annotations

import logging
import threading

from dsv4_patch import node, patch, record, registry
from dsv4_patch.version import vllm_version

logger = logging.getLogger("dsv4_patch")

_lock = threading.Lock()


def register() -> record.PatchRecord:
    """Install the patches for this process once; return the process record."""
    with _lock:
        existing = record.current()
        if existing is not None:
            return existing
        rec = record.PatchRecord(vllm_version=vllm_version(), platform=node.platform_kind())
        patch.install(rec, registry.all_patches())
        record.publish(rec)
    logger.info(rec.summary())
    return rec
