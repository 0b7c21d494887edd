"""The serving core: the DSv4 server replica and the one-pool application.

``names`` (deployment names, light), ``boot`` (the replica's start), ``router`` (Serve
routing that skips drained replicas), ``server`` (Ray Serve LLM's ``LLMServer`` plus the
KV self-check; it composes the replica's doors, ``deployments.doors.lifecycle``),
``builder`` (the one-pool app and the pieces every pattern shares), ``server_options``
(the server deployment's options without importing Ray Serve LLM's server, so the
process that builds the app imports no vLLM), ``llm_build`` (the same
through Ray Serve LLM's builders: DP gangs, P/D, what ``server_options`` does not cover).
Serving patterns (``deployments.pd``) import this package, never the reverse.
"""
