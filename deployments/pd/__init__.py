"""Prefill/decode disaggregation: the second serving pattern, built on ``serving``.

``compat`` (may this prefill replica hand its pages to that decode one: pure),
``route`` (which prefill replicas a decode replica may use), ``server`` (Ray Serve LLM's
P/D servers with our checks), ``controller`` (both pools' checks plus the P/D verdict),
``builder`` (the application). Imports ``serving`` and below, never the reverse.
"""
