"""Prefill/decode disaggregation: the second serving pattern, built on ``serving``.

``compat`` (may this prefill replica hand its pages to that decode one: pure),
``route`` (which prefill replicas a decode replica may use), ``server`` (Ray Serve LLM's
P/D servers with our checks), ``controller`` (both pools' checks plus the P/D verdict),
``builder`` (the application), ``canary`` + ``canary_run`` + ``canary_watch`` (the output
canary per pair: its rules, its run on the decode replica, the whitelist it gates),
``failed_transfers`` (the decode replica's count of failed KV transfers, from vLLM's NIXL
counter). Imports ``serving`` and below, never the reverse.
"""
