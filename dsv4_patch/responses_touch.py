"""vLLM's Responses state, moved per instance into the fleet's store (documented, probed).

The change itself is made by ``deployments.responses.binding`` on the replica's own
``OpenAIServingResponses`` instance (never on the class, never in another process);
this module is its entry in the registry (``registry.all_reads``) so ``dsv4-serve
doctor`` shows it and the binding refuses to start when the probe fails.
"""

from __future__ import annotations

import importlib
import inspect

from dsv4_patch.patch import Read

MODULE = "vllm.entrypoints.openai.responses.serving"
CLASS = "OpenAIServingResponses"
# The dicts vLLM creates in __init__ and the methods the binding wraps.
STATE = ("response_store", "msg_store", "event_store", "background_tasks")
METHODS = ("create_responses", "retrieve_responses", "cancel_responses",
           "_run_background_request", "_run_background_request_stream",
           "create_error_response")


def _probe() -> str | None:
    """None when the installed vLLM keeps its Responses state as the binding expects."""
    try:
        cls = getattr(importlib.import_module(MODULE), CLASS)
    except (ImportError, AttributeError) as exc:
        return f"cannot import {MODULE}.{CLASS}: {exc}"
    missing = [m for m in METHODS if not callable(getattr(cls, m, None))]
    try:
        init = inspect.getsource(cls.__init__)
    except (OSError, TypeError) as exc:
        return f"cannot read {CLASS}.__init__: {exc}"
    missing += [f"self.{a}" for a in STATE if f"self.{a}" not in init]
    module = importlib.import_module(MODULE)
    missing += [n for n in ("ErrorResponse", "ResponsesResponse") if not hasattr(module, n)]
    return f"{MODULE}.{CLASS} lacks {', '.join(missing)}" if missing else None


READ = Read(
    name="responses.store",
    module=MODULE,
    target=f"{MODULE}:{CLASS}.{{{', '.join(STATE)}}} and .{{{', '.join(METHODS[:5])}}} "
           "(per instance)",
    why="vLLM keeps stored responses, their input messages, background event streams and "
        "tasks in per-process dicts that are never evicted: a follow-up on another replica "
        "404s, and a replacement, scale-down or node loss deletes them",
    how="on the replica's own instance: the three dicts become owner-scoped local views; "
        "create/retrieve/cancel load from the shared store (SQLite or Redis) before vLLM "
        "runs and save what it wrote after, with a deadline; background runs save their "
        "final state and see cancels made elsewhere by polling. The class is untouched",
    upstream="RFC vllm#26934 (pluggable Responses store); PRs vllm#35905 and vllm#37938 "
             "were closed unmerged",
    affected="vLLM 0.32.0-0.34.0 (same attributes and signatures, checked)",
    remove_when="vLLM ships a pluggable Responses store with owner scoping and eviction",
    probe=_probe,
)
