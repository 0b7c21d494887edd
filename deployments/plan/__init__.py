"""``dsv4-serve plan``: a config's layout, bytes and capacity, decided without GPUs.

``model_configs`` (where a model's config.json is found), ``weights`` (weight bytes and
their split), ``capacity`` (KV capacity per engine and replica), ``pd`` (bytes a P/D
request moves), ``preflight`` (the whole plan), ``findings`` (what plan finds wrong in
one application and across a config), ``kv_figures`` (plan's KV capacity per node type,
for the controller's gauges). Built on ``config`` and
``dsv4_patch.rules``; no vLLM, no Ray, no GPU. Two modules read files and nothing
else does: ``model_configs`` (a model's config.json) and ``preflight.plan_config``
(the Serve config, then the model's); the rest is pure over what they read.
"""
