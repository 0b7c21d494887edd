"""dsv4_patch: make ``kv_cache_dtype="auto"`` work for DeepSeek-V4 on every vLLM.

Layers, bottom to top (nothing imports upward):

- ``rules``      pure: KV layouts (per-release tables), dtype resolution, the byte model.
                 No vLLM import.
- ``record``     pure: what the plugin did in this process (JSON-safe).
- ``patch`` / ``registry``  every touch of vLLM internals, documented and probed: the
                 patches (``patches``, ``cpu_compat``, ``cpu_ops``) and the reads
                 (``selector``, ``worker_ext``).
- ``selector``   the installed vLLM's own DeepSeek-V4 attention-class (layout) choice.
- ``cpu_compat`` PyTorch stand-ins for Triton-only kernels, CPU platform only.
- ``plugin``     the ``vllm.general_plugins`` entry point; applies ``patches``.
- ``worker_ext`` ``worker_extension_cls`` mixin: KV specs as plain dicts.
- ``tiny_model`` a tiny random-weight DeepSeek-V4 for CPU runs and tests.
- ``doctor``     a report of version, platform, layout and patches.

This package never imports Ray.
"""

__version__ = "0.1.0"
