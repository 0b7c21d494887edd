"""A serving replica's side of the store: bind it to vLLM's app, owner scope, metrics.

Called once per replica from ``__serve_build_asgi_app__`` (after the edge is in
place): the store opens, vLLM's ``OpenAIServingResponses`` instance is bound to it
(``binding``), ``views.OwnerScope`` goes in as the innermost middleware (inside the
edge's auth, which leaves the key digest in the scope), and one task polls for
cancels made elsewhere and reports the store's size.
"""

from __future__ import annotations

import asyncio
from typing import Any

from deployments.config.responses import ResponsesStore as StoreSettings
from deployments.http.edge import place_innermost
from deployments.logs import get_logger
from deployments.observe import series
from deployments.responses.binding import StoreBinding
from deployments.responses.open import open_store
from deployments.responses.views import OwnerScope

logger = get_logger("responses")


class ReplicaStore:
    """The replica's bound store and its poller (``close`` on shutdown)."""

    def __init__(self, binding: StoreBinding, poller: asyncio.Task[None]) -> None:
        self.binding, self.poller = binding, poller

    async def close(self) -> None:
        self.poller.cancel()
        await asyncio.gather(self.poller, return_exceptions=True)
        await self.binding.store.close()


def store_metrics() -> tuple[Any, Any]:
    """``dsv4_responses_store_records`` (the store's size, as this replica last read it)
    and ``dsv4_responses_store_errors_total`` by operation (read, write, poll)."""
    return series.make(series.RESPONSES_RECORDS), series.make(series.RESPONSES_ERRORS)


def bind_store(app: Any, settings: StoreSettings, app_name: str) -> ReplicaStore:
    """Bind vLLM's Responses state in ``app`` to the store ``settings`` name."""
    serving = getattr(app.state, "openai_serving_responses", None)
    if serving is None:
        raise RuntimeError("http.responses_store is on but vLLM's app has no Responses "
                           "handler (app.state.openai_serving_responses). Fix: set "
                           "http.responses_store: false for this model.")
    size, errors = store_metrics()
    store = open_store(settings, app_name)
    binding = StoreBinding(serving, store, settings.cancel_poll_s,
                           on_error=lambda op: errors.inc(tags={"op": op}))
    binding.install()
    place_innermost(app, (OwnerScope, {}))  # inside the edge and vLLM's own layers
    poller = asyncio.get_running_loop().create_task(
        binding.run_poller(lambda n: size.set(n)), name="dsv4-responses-poller")
    logger.info("dsv4: Responses state in the shared %s store: any replica serves "
                "follow-ups; cancels seen within %.1f s", store.kind, settings.cancel_poll_s)
    return ReplicaStore(binding, poller)
