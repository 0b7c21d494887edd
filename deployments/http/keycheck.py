"""Edge middleware: a valid ``Authorization: Bearer <key>`` on every route, ``/health`` included.

The shape of vLLM's ``AuthenticationMiddleware(app, tokens)``, with our ``KeyStore``
(``deployments.http.auth``: rotation, key files, fail-closed rules). It records who
asked: the SHA-256 hex digest of the presented key (never the key) in
``scope["state"]["dsv4_key_digest"]`` (None when no key is required), which the
Responses store uses as the owner of what a request stores.

A CORS preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``)
skips the check only when CORS is configured: a browser sends it without credentials
and the CORS middleware behind answers it without reaching a route.
"""

from __future__ import annotations

import hashlib

from starlette.types import ASGIApp, Receive, Scope, Send

from deployments.http.auth import KeyStore, bearer_token
from deployments.http.refusal import (
    Refusal,
    RefusingMiddleware,
    header,
    logger,
)

KEY_DIGEST = "dsv4_key_digest"


def key_digest(key: str) -> str:
    """Who a key is, for ownership: its SHA-256 hex digest."""
    return hashlib.sha256(key.encode()).hexdigest()


def set_owner(scope: Scope, digest: str | None) -> None:
    state = scope.get("state")
    if not isinstance(state, dict):
        state = scope["state"] = {}
    state[KEY_DIGEST] = digest


def is_preflight(scope: Scope) -> bool:
    """A CORS preflight: only that skips the key check; any other ``OPTIONS`` is judged."""
    return (scope.get("method") == "OPTIONS" and bool(header(scope, b"origin"))
            and bool(header(scope, b"access-control-request-method")))


class AuthMiddleware(RefusingMiddleware):
    """401 without a valid key; 503 (detail in the log only) when the check itself fails."""

    def __init__(self, app: ASGIApp, keys: KeyStore, bind_host: str | None,
                 cors: bool = False):
        self.app, self.keys, self.bind_host, self.cors = app, keys, bind_host, cors

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.cors and is_preflight(scope):
            await self.app(scope, receive, send)
            return
        set_owner(scope, self._owner(scope))
        await self.app(scope, receive, send)

    def _owner(self, scope: Scope) -> str | None:
        """The presented key's digest; None when no key is required; else refuses."""
        request_id = header(scope, b"x-request-id") or "?"
        try:
            if not self.keys.required(self.bind_host):
                return None
            token = bearer_token(header(scope, b"authorization"))
            ok = token is not None and self.keys.matches(token)
        except Exception as exc:  # the key file's path must not reach a caller
            logger.exception("dsv4: request %s: the API key check failed", request_id)
            raise Refusal(503, f"the server cannot check API keys right now (request id "
                          f"{request_id}). Fix: retry later; the operator finds the cause "
                          "in the server log under that id.", "unavailable", "keys",
                          headers=[(b"retry-after", b"5")]) from exc
        if not ok:
            what = "no API key" if token is None else "an invalid API key"
            raise Refusal(401, f"the request has {what}. Fix: send `Authorization: Bearer "
                          "<key>` with a key the server operator gave you.",
                          "authentication_error", "keys",
                          headers=[(b"www-authenticate", b"Bearer")])
        assert token is not None
        return key_digest(token)
