"""Replica boot: what Ray Serve LLM runs around the engine start that a replica can skip.

Two things, each a fresh Ray worker process on the replica's boot path.

**The node-initialization task.**
Before the engine starts, Ray Serve LLM 2.60 runs ``initialize_remote_node`` as a
Ray task on every node of the replica's placement group
(``ray.llm._internal.serve.utils.node_initialization_utils.initialize_node``): it
downloads the model, tokenizer and extra files. For a model that is a local
directory there is nothing to download, but the task still costs a fresh Ray
worker process (Python + Ray + ray.llm imports) between the replica and its engine:
measured ~15 s of a 2-core boot under load (``docs/benchmarks.md`` section 2b).

``LocalModelCallback`` is a Ray Serve LLM node-init callback (``LLMConfig.callback_config``,
the documented extension point) that sets ``ctx.run_init_node = False`` only when the
model source is a directory on this node and every bundle of the placement group is
on this node too (other nodes might not have the directory: they keep the download).

**The usage-telemetry push.** After the engine starts, ``LLMServer._start_engine``
calls ``push_telemetry_report_for_all_models``, which creates (or finds) the detached
``TelemetryAgent`` actor and blocks on its ``record``: on a fresh cluster a new worker
process, Ray Serve LLM's imports in it, then the call, all before the replica can
answer (~3 s of a 2-core local boot, and a resident process at 0.8 % of a core:
docs/benchmarks.md §2g). The report only feeds Ray's usage stats.
``keep_telemetry_off_boot_path`` makes the push skip when Ray's usage stats are off in
this process (a ``ray.init`` cluster turns them off itself, so every local run), and
otherwise run on a daemon thread once the engine is up: the same report, not waited for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray.llm._internal.common.callbacks.base import CallbackBase

from deployments import ray_touches
from deployments.logs import get_logger

logger = get_logger("boot")


def _pg_nodes(placement_group: Any) -> set[str]:
    import ray

    table = ray.util.placement_group_table(placement_group)
    return set(table.get("bundles_to_node_id", {}).values())


def skip_reason(model_source: str | None, this_node: str, pg_nodes: set[str]) -> str | None:
    """Why the download task can be skipped here, or None when it must run."""
    if not model_source or not Path(model_source).is_dir():
        return None
    if not pg_nodes or pg_nodes != {this_node}:
        return None
    return f"model_source {model_source} is a directory on this node, the only node of " \
           "the placement group"


class LocalModelCallback(CallbackBase):
    """Ray Serve LLM's default callback, minus the download task when there is nothing
    to download (see the module docstring)."""

    async def on_before_node_init(self) -> None:
        import ray

        source = self.llm_config.model_loading_config.model_source
        reason = skip_reason(source if isinstance(source, str) else None,
                             ray.get_runtime_context().get_node_id(),
                             _pg_nodes(self.ctx.placement_group)
                             if self.ctx.placement_group is not None else set())
        if reason:
            self.ctx.run_init_node = False
            logger.info("dsv4: skipping Ray Serve LLM's node-initialization task: %s", reason)


_TELEMETRY_LOCK = threading.Lock()
_telemetry_installed = False


def deferred_push(push: Callable[..., None], usage_stats_on: bool) -> Callable[..., None]:
    """``push`` (Ray Serve LLM's telemetry push, which never raises), run on a daemon
    thread when usage stats are on, not at all when they are off."""

    def push_later(*args: Any, **kwargs: Any) -> None:
        if not usage_stats_on:
            return
        threading.Thread(target=push, args=args, kwargs=kwargs, daemon=True,
                         name="dsv4-llm-telemetry").start()

    return push_later


def keep_telemetry_off_boot_path() -> None:
    """Install ``deferred_push`` in this replica process, once (module docstring)."""
    global _telemetry_installed
    with _TELEMETRY_LOCK:
        if _telemetry_installed:
            return
        if not ray_touches.present("ray_llm.telemetry_push"):
            logger.warning("dsv4: this Ray lacks ray_llm.telemetry_push (deployments/"
                           "ray_touches/): Ray Serve LLM's usage report stays on the "
                           "replica's boot path (slower start, nothing lost)")
            _telemetry_installed = True
            return
        from ray._common.usage import usage_lib
        from ray.llm._internal.serve.core.server import llm_server

        usage_stats_on = usage_lib.usage_stats_enabled()
        llm_server.push_telemetry_report_for_all_models = deferred_push(
            llm_server.push_telemetry_report_for_all_models, usage_stats_on)
        _telemetry_installed = True
    logger.info("dsv4: Ray Serve LLM's usage report %s", "pushed on a background thread "
                "after the engine starts (not waited for)" if usage_stats_on else
                "not pushed: Ray's usage stats are off here (RAY_USAGE_STATS_ENABLED=0; "
                "ray.init clusters set it), so nothing would read it")
