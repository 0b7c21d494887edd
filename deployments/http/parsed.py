"""A body judged on the values vLLM's request models make of it, and re-encoded with them.

vLLM's models validate the decoded JSON in pydantic's lax mode (FastAPI validates in
Python mode): ``"background": 1``, ``"yes"``, ``"true"`` and ``1.0`` are ``True``;
``"n": "256"`` and ``256.0`` are 256. The edge coerces every field it judges
(``fields.judged``: the route's bounds and store gates) with one pydantic adapter per
type the field table names, judges the coerced values, and when a coerced value differs
from what was sent (in type or value) re-encodes the body with it: vLLM then reads
exactly the value the edge judged. A value that does not coerce is left as sent; vLLM's
model refuses it with a 400 naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from deployments.config import HTTPEdge
from deployments.http import fields, routes
from deployments.http.bounds import bytes_problem, parsed_problem

# One lax adapter per type the field table names; ``None`` is a value vLLM's optional
# fields take (the field's default then applies).
COERCE: dict[str, TypeAdapter[Any]] = {
    "int": TypeAdapter(int | None), "bool": TypeAdapter(bool | None),
    "str": TypeAdapter(str | None)}
_MISSING = object()


@dataclass(frozen=True)
class Judged:
    """The edge's verdict on one body: ``problem`` (param, message) or None, the bytes
    vLLM is to read, and the parsed body (None when it is not JSON)."""

    problem: tuple[str | None, str] | None
    raw: bytes
    body: Any = None


def coerce(body: Any, judged: dict[str, str]) -> bool:
    """Replace each judged field of ``body`` (in place) by vLLM's coerced value; True
    when any value changed in type or value (the body must then be re-encoded)."""
    changed = False
    if not isinstance(body, dict):
        return False
    for path, kind in judged.items():
        *parents, name = path.split(".")
        holder: Any = body
        for part in parents:
            holder = holder.get(part) if isinstance(holder, dict) else None
        if not isinstance(holder, dict):
            continue
        sent = holder.get(name, _MISSING)
        if sent is _MISSING:
            continue
        try:
            value = COERCE[kind].validate_python(sent)
        except ValidationError:
            continue  # vLLM's model refuses it: its 400 names the field
        if type(value) is not type(sent) or value != sent:
            holder[name] = value
            changed = True
    return changed


def judge(raw: bytes, settings: HTTPEdge, route: routes.Route) -> Judged:
    """The whole judgement of one body on ``route`` before vLLM reads it."""
    message = bytes_problem(raw, settings)
    if message:
        return Judged((None, message), raw)
    try:
        body = json.loads(raw)
    except ValueError:
        return Judged(None, raw)  # not JSON: the request schema's 400 gives the position
    if coerce(body, fields.judged(route)):
        raw = json.dumps(body).encode()
    return Judged(parsed_problem(body, settings, route), raw, body)
