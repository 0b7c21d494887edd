"""The HTTP face of a serving replica: vLLM's OpenAI app behind our edge.

``auth`` (API keys: sources, comparison, refusal), ``errors`` (OpenAI-shaped client errors,
5xx scrubbing), ``edge`` (the ASGI middleware: keys, routes, bounds, in-flight share,
stream limits), ``public`` (what ``GET /v1/kv-spec`` shows), ``front`` (assembles the app
a replica serves). Imports ``config`` and the light root modules only: the serving
patterns call it, never the reverse.
"""
