"""``dsv4-serve plan``: a config's layout, bytes and capacity, decided without GPUs.

``model_configs`` (where a model's config.json is found), ``weights`` (weight bytes and
their split), ``capacity`` (KV capacity per engine and replica), ``pd`` (bytes a P/D
request moves), ``preflight`` (the whole plan). Pure over ``config`` and
``dsv4_patch.rules``.
"""
