"""Client errors in the route's protocol: bad bodies get 400s that name the field, never 500s.

Used by the HTTP front (``deployments.http.front.harden``) on vLLM's OpenAI app, and by
the edge (``deployments.http.edge``) for the one bad input vLLM's own request model turns
into a 500 (``"messages": null``, see ``messages_problem``).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from deployments.http.refusal import error_payload, protocol_of

# Bounds on what a 400 echoes back: pydantic repeats the offending input in every
# error, and a hostile body must not turn into a large (or unserializable) answer.
_MAX_REPORTED_ERRORS = 5
_MAX_ECHO_CHARS = 80
# pydantic-core schema markers that show up in ``loc`` for union/wrapped fields;
# they are not field names a client could act on.
_LOC_MARKERS = frozenset({"function-wrap", "function-after", "function-before",
                          "function-plain", "json-or-python", "lax-or-strict", "chain",
                          "default", "nullable", "tagged-union", "union", "str", "int",
                          "float", "bool", "bytes", "list", "tuple", "dict", "none"})


def echo(value: Any) -> str:
    """A short, always JSON-safe description of a rejected input value.

    Ray Serve LLM 2.60 and vLLM echo the raw input: raw ``bytes`` (a non-JSON body)
    and ``NaN`` (which Python's JSON parser accepts) then fail to serialize and the
    client gets a 500 instead of the 400 it earned.
    """
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes of non-JSON body>"
    if isinstance(value, (list, tuple, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = repr(value)
    return text if len(text) <= _MAX_ECHO_CHARS else text[:_MAX_ECHO_CHARS] + "..."


def _param(loc: tuple[Any, ...]) -> str | None:
    """The client-facing field path of a pydantic ``loc`` (``"messages.0.role"``)."""
    parts = [str(p) for p in loc[1:] if not (set(str(p)) & set("[](){}")
                                              or str(p).lower() in _LOC_MARKERS)]
    return ".".join(parts) or None


def _error_param(error: dict[str, Any] | str) -> str | None:
    """The field an error is about: our validators name it in ``ctx``, pydantic in ``loc``."""
    if isinstance(error, str) or error.get("type") == "json_invalid":
        return None
    return (error.get("ctx") or {}).get("param") or _param(tuple(error.get("loc", ())))


def _describe(error: dict[str, Any] | str, content_type: str) -> str:
    """One validation error as ``field: what was wrong (got value)``, with the fix.

    vLLM raises some as plain strings (``validate_json_request``: "Unsupported Media
    Type: Only 'application/json' is allowed"); they get the Content-Type fix.
    """
    if isinstance(error, str):
        return (f"{error}. Fix: send a JSON object with Content-Type: application/json "
                f"(got Content-Type: {content_type or 'none'})")
    kind, ctx = error.get("type"), error.get("ctx") or {}
    if kind == "json_invalid":
        return (f"the body is not valid JSON ({ctx.get('error', '')} at character "
                f"{error['loc'][-1]}). Fix: send one JSON object.")
    if kind == "missing" and tuple(error.get("loc", ())) == ("body",):
        return "the body is empty. Fix: send one JSON object."
    where = _error_param(error) or "body"
    if "param" in ctx:  # our own validators: the message names value and fix
        return f"{where}: {error.get('msg')}"
    text = f"{where}: {error.get('msg', 'invalid')}"
    if kind != "missing":
        text += f" (got {echo(error.get('input'))})"
    if isinstance(error.get("input"), (bytes, bytearray)):
        text += (f". Fix: send a JSON object with Content-Type: application/json "
                 f"(got Content-Type: {content_type or 'none'})")
    return text


async def openai_validation_error(request: Request,
                                  exc: RequestValidationError) -> JSONResponse:
    """A request the schema rejects gets 400 with an OpenAI error, never a 500.

    400 and ``invalid_request_error`` are what the OpenAI API and vLLM's own server
    (``vllm.entrypoints.serve.exception_handling``) answer for a body that fails
    validation, malformed JSON included; unlike those handlers this one never
    echoes raw input (bytes, NaN). ``param`` names the first offending field.
    """
    errors = list(exc.errors())
    content_type = request.headers.get("content-type", "")
    lines = [_describe(e, content_type) for e in errors[:_MAX_REPORTED_ERRORS]]
    if len(errors) > _MAX_REPORTED_ERRORS:
        lines.append(f"...and {len(errors) - _MAX_REPORTED_ERRORS} more")
    param = _error_param(errors[0]) if errors else None
    body = error_payload(400, "Invalid request: " + ("; ".join(lines) or "validation failed"),
                         "invalid_request_error", param, protocol_of(request.scope))
    return JSONResponse(body, status_code=400)


_KIND = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
         415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}


async def openai_http_error(request: Request, exc: Exception) -> JSONResponse:
    """An ``HTTPException`` (FastAPI's own, e.g. "There was an error parsing the body"
    for a body that is not UTF-8, or a route's) as an OpenAI error, never ``{"detail"}``.

    Starlette's default handler answers ``{"detail": ...}``, which OpenAI clients
    cannot parse; vLLM's handler covers only ``fastapi.HTTPException``.
    """
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
    if status == 400 and "parsing the body" in detail:
        detail += ". Fix: send one JSON object, UTF-8 encoded, with Content-Type: " \
                  "application/json"
    kind = _KIND.get(status, "internal_server_error" if status >= 500 else
                     "invalid_request_error")
    body = error_payload(status, detail, kind, protocol=protocol_of(request.scope))
    return JSONResponse(body, status_code=status, headers=getattr(exc, "headers", None))


def messages_problem(body: Any) -> str | None:
    """Why a chat body's ``messages`` is unusable before any model sees it, else None.

    vLLM's ``ChatCompletionRequest.check_system_message_content_type`` (a
    ``mode="before"`` validator, vLLM 0.32) iterates ``data.get("messages", [])``:
    ``"messages": null`` (or a number) raises ``TypeError``, which pydantic does
    not turn into a validation error, so the client got a 500. Delete this once
    vLLM guards that loop.
    """
    if not isinstance(body, dict) or "messages" not in body:
        return None
    messages = body["messages"]
    if isinstance(messages, list):
        return None
    return (f"messages: got {echo(messages)} ({type(messages).__name__}): expected a list "
            'of message objects. Fix: send e.g. "messages": [{"role": "user", '
            '"content": "Hi"}]')
