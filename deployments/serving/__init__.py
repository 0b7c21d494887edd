"""The serving core: the DSv4 server replica and the one-pool application.

``names`` (deployment names, light), ``boot`` (the replica's start), ``router`` (Serve
routing that skips drained replicas), ``server`` (Ray Serve LLM's ``LLMServer`` plus the
KV self-check), ``builder`` (the one-pool app and the pieces every pattern shares).
Serving patterns (``deployments.pd``) import this package, never the reverse.
"""
