"""The HTTP face of a serving replica: vLLM's OpenAI app behind our edge.

``auth`` (API keys: sources, comparison, refusal), ``errors`` (OpenAI-shaped client
errors), ``routes`` (what is served with the fields each bounds; what is closed, and
why), ``bounds`` (the body checks: linear, judged as vLLM reads them), ``edge`` (the
ASGI middleware: keys, routes, bounds, in-flight share, stream limits, 5xx scrubbing,
the Responses store layer), ``public`` (what ``GET /v1/kv-spec`` shows),
``front`` (assembles the app a replica serves). Imports ``config`` and the light root
modules only: the serving patterns call it, never the reverse. The doors a request
comes in by (the replica's own port, HAProxy) are ``deployments.doors``.
"""
