"""Replica boot: skip Ray Serve LLM's node-initialization task when it has nothing to do.

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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.llm._internal.common.callbacks.base import CallbackBase

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
