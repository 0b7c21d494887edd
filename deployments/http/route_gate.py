"""Edge middleware: only the routes this deployment serves, before any body is read.

404 for a route not in ``deployments.http.routes`` (a closed one says why), 405 for
the wrong method, 400 for Serve's multiplexed-model header (LoRA is refused), 404 for
the stored-response routes while ``http.responses_store`` is off. WebSocket
connections are refused: no served route is one, and none may bypass the edge. The
matched ``Route`` goes into the scope (``ROUTE_KEY``) for the middlewares behind.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from deployments.http import routes
from deployments.http.bounds import STORE_SETTING
from deployments.http.keycheck import is_preflight
from deployments.http.refusal import (
    Refusal,
    RefusingMiddleware,
    header,
    logger,
    route_path,
)

ROUTE_KEY = "dsv4.route"
# Serve's proxy turns this header into a multiplexed (LoRA) model id; refused with
# LoRA itself (``deployments.serving.builder.refuse_lora``).
MULTIPLEXED_HEADER = b"serve_multiplexed_model_id"
_RESPONSES = routes.EXACT[routes.RESPONSES_ROUTE]


def check_route(path: str, method: str) -> routes.Route:
    """The served route, or 404 (with the reason for a closed one) / 405."""
    route = routes.find(path)
    if route is None:
        why = routes.CLOSED.get(path)
        text = f"is closed on this server: {why}" if why else "does not exist"
        raise Refusal(404, f"route {path} {text}. Served routes: "
                      f"{', '.join(routes.SERVED)}.", "not_found_error", "routes")
    if method != route.method:
        raise Refusal(405, f"{method} {path}: this route takes {route.method}.",
                      "invalid_request_error", "routes",
                      headers=[(b"allow", route.method.encode())])
    return route


class RouteMiddleware(RefusingMiddleware):
    """See the module docstring."""

    def __init__(self, app: ASGIApp, responses_store: bool = False, cors: bool = False):
        self.app, self.responses_store, self.cors = app, responses_store, cors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await _refuse_websocket(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope)
        if self.cors and is_preflight(scope):
            await self.app(scope, receive, send)  # answered by the CORS middleware behind
            return
        if header(scope, MULTIPLEXED_HEADER):
            raise Refusal(400, f"header {MULTIPLEXED_HEADER.decode()} asks for a LoRA "
                          "adapter (Serve model multiplexing); this deployment serves no "
                          "adapters. Fix: drop the header and name the base model in "
                          "`model`.", "invalid_request_error", "routes")
        route = check_route(path, scope.get("method", "GET"))
        if route.stateful and not self.responses_store and route is not _RESPONSES:
            raise Refusal(404, f"response {routes.response_id(path)} was not stored: this "
                          f"server does not store responses ({STORE_SETTING} is false). "
                          "Fix: keep the response the create call returned, or ask the "
                          f"operator to enable {STORE_SETTING}.", "not_found_error", "routes")
        scope[ROUTE_KEY] = route
        await self.app(scope, receive, send)


async def _refuse_websocket(scope: Scope, receive: Receive, send: Send) -> None:
    """Close a WebSocket before it is accepted (the server answers 403)."""
    message = await receive()
    logger.info("dsv4: refused a WebSocket connection to %s", route_path(scope))
    if message["type"] == "websocket.connect":
        await send({"type": "websocket.close", "code": 1008,
                    "reason": "WebSocket is not served here"})
