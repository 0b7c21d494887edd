"""The engine-lifetime patch: every process vLLM spawns watches its parent
(``dsv4_patch.patches.lifetime``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from dsv4_patch.patch import Patch, Verdict

# ------------------------------------------------------- engine process lifetime

LIFETIME_MODULE = "vllm"  # imported in every process that loads the plugin
UPSTREAM_PARENT_MONITOR = "vllm.utils.system_utils.monitor_parent_death"


def upstream_parent_monitor() -> bool:
    """True when the installed vLLM's engine core watches its parent itself (#55846)."""
    module_name, _, attr = UPSTREAM_PARENT_MONITOR.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return False
    return hasattr(module, attr)


def _probe_parent_watch(module: ModuleType) -> Verdict:
    """Needed on every vLLM without an engine-core parent monitor (what doctor reports)."""
    if upstream_parent_monitor():
        return Verdict(False, f"vLLM has {UPSTREAM_PARENT_MONITOR}")
    return Verdict(True, "the engine core does not watch its parent")


def _patch_parent_watch(module: ModuleType) -> str:
    """Start ``lifetime.watch_parent`` in processes vLLM spawned (engine core, workers)."""
    from dsv4_patch.patches import lifetime

    parent = lifetime.watch_parent()
    if parent is None:
        return ("not started by multiprocessing: no owner to watch in this process (the "
                "watch runs in the engine core and workers vLLM spawns)")
    return f"ends with its parent, process {parent}"


PARENT_WATCH = Patch(
    name="dsv4.engine_dies_with_owner",
    module=LIFETIME_MODULE,
    target="vllm: the lifetime of the VLLM::EngineCore and VLLM::Worker processes",
    why=(
        "vLLM's engine core does not watch the process that spawned it: when a Serve "
        "replica dies without its shutdown (raylet/GCS killed, node lost, SIGKILL, OOM), "
        "its EngineCore and Workers live on under PID 1 with their memory and CPU."
    ),
    how=(
        "In a process multiprocessing spawned, a daemon thread waits on the parent "
        "sentinel; when the parent is gone it sends SIGTERM to its own process (vLLM's "
        "shutdown runs: requests aborted, workers stopped), SIGKILL after a grace period."
    ),
    upstream="vllm-project/vllm#55510 (bug), #55846 (death pipe for EngineCore, open), "
             "#34816 (PR_SET_PDEATHSIG, open)",
    affected="vLLM 0.20.0-0.33.x (no parent monitor in the engine core)",
    remove_when=f"{UPSTREAM_PARENT_MONITOR} (or an equivalent) exists in the oldest "
                "supported vLLM",
    probe=_probe_parent_watch,
    change=_patch_parent_watch,
)
