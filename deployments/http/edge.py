"""The HTTP edge of a serving replica: a stack of small ASGI middlewares in front of vLLM's app.

Outermost first (``edge_stack``, the one place the order is decided; ``place`` and
``place_innermost`` are the only code that puts layers into an app):

1. ``scrub.ScrubMiddleware``: a request id; no 5xx body or stream error event leaves
   with internals in it, in any protocol;
2. ``keycheck.AuthMiddleware``: **401** without a valid key, on every route; records
   the key's digest as the request's owner;
3. ``route_gate.RouteMiddleware``: **404/405** for routes this deployment does not
   serve, before the body is read; WebSockets refused;
4. ``admission.AdmissionMiddleware``: an in-flight slot (**503**) before the body
   uploads, the body's deadline (**408**), size (**413**) and fields (**400**,
   ``bounds``/``fields``); background Responses runs hold their slot;
5. ``stream_limit.StreamLimitMiddleware``: ``stream_max_s``/``stream_idle_s``.

Each is configured through its constructor from an ``Edge``, which the replica that
builds the app creates and owns (no module state). Every refusal is a
``problem.Refusal`` sent by ``problem.refuse``, in the route's protocol (OpenAI's
or Anthropic's). An absent token limit is bounded by the engine: the builder sets
vLLM's ``override_generation_config.max_new_tokens`` to ``http.max_tokens``.
Pure ASGI (no ``BaseHTTPMiddleware``), so client disconnects still reach the app.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware

from deployments.config import HTTPEdge
from deployments.http import timing
from deployments.http.admission import AdmissionMiddleware, BackgroundTasks, Slots
from deployments.http.auth import KeyStore
from deployments.http.keycheck import AuthMiddleware
from deployments.http.refusal import logger
from deployments.http.route_gate import RouteMiddleware
from deployments.http.scrub import ScrubMiddleware
from deployments.http.stream_limit import StreamLimitMiddleware


def in_flight_share(settings: HTTPEdge, replicas: int) -> tuple[HTTPEdge, str]:
    """This replica's part of the fleet-wide ``http.max_in_flight`` and how it was derived.

    Every serving replica is an ingress with its own edge; ``http.max_in_flight``
    stays the bound for the whole deployment at its largest, so each replica admits
    ``ceil(max_in_flight / replicas)``. ``replicas`` counts Serve replicas: with DP
    attention every rank is one (``AppArgs.max_serving_replicas``).
    """
    if replicas <= 1:
        return settings, ""
    share = -(-settings.max_in_flight // replicas)
    note = f" {settings.max_in_flight} over at most {replicas} replicas"
    return settings.model_copy(update={"max_in_flight": share}), note


@dataclass
class Edge:
    """One replica's edge: its settings, keys, bind address and in-flight slots."""

    settings: HTTPEdge
    keys: KeyStore
    bind_host: str | None
    slots: Slots

    @classmethod
    def start(cls, settings: HTTPEdge, bind_host: str | None,
              environ: dict[str, str] | None = None, limit_note: str = "") -> Edge:
        """Build the edge; raises ``AuthConfigError`` when the auth settings cannot hold."""
        keys = KeyStore(settings.auth, environ)
        keys.check_startup(bind_host)
        if keys.required(bind_host):
            logger.info("dsv4: API keys required on every route (%s)", "; ".join(keys.sources))
        else:
            logger.warning("dsv4: API keys not required now (http.auth.mode=%s, proxy host "
                           "%r, no key configured)", settings.auth.mode, bind_host)
        slots = Slots(settings.max_in_flight, limit_note, settings.retry_after_s)
        return cls(settings, keys, bind_host, slots)

    @property
    def in_flight(self) -> int:
        return self.slots.in_flight


# (middleware class, its constructor kwargs) for one layer of the stack.
Layer = tuple[Callable[..., Any], dict[str, Any]]


def edge_stack(edge: Edge, background_tasks: BackgroundTasks | None = None,
               inside: Sequence[Layer] = ()) -> list[Layer]:
    """The edge's middlewares, outermost first: the one place their order is decided.

    Another part (a Responses store, metrics) joins the edge by adding its layer here.
    ``inside``: the front's own layers (``front.harden``: public model cards, CORS),
    just inside the edge and outside the app's own middlewares.
    """
    s = edge.settings
    cors = bool(s.cors_allow_origins)
    return timing.around([  # the serving path's own time per stage, around the edge
        (ScrubMiddleware, {"retry_after_s": s.retry_after_s}),
        (AuthMiddleware, {"keys": edge.keys, "bind_host": edge.bind_host, "cors": cors}),
        (RouteMiddleware, {"responses_store": s.responses_store, "cors": cors}),
        (AdmissionMiddleware, {"settings": s, "slots": edge.slots,
                               "background_tasks": background_tasks}),
        (StreamLimitMiddleware, {"stream_max_s": s.stream_max_s,
                                 "stream_idle_s": s.stream_idle_s}),
    ]) + list(inside)


def middleware(layers: list[Layer]) -> list[Middleware]:
    """Starlette's ``user_middleware`` entries for ``layers`` (outermost first)."""
    return [Middleware(cls, **kwargs) for cls, kwargs in layers]


def place(app: Starlette, layers: list[Layer]) -> None:
    """Put ``layers`` (``edge_stack``'s, outermost first) in front of the app's own."""
    app.user_middleware[:0] = middleware(layers)


def place_innermost(app: Starlette, layer: Layer) -> None:
    """Put ``layer`` next to the handler, inside every middleware the app has (vLLM's
    too); the app rebuilds its stack on the next request."""
    app.user_middleware.append(Middleware(layer[0], **layer[1]))
    app.middleware_stack = None
