"""Whether vLLM loads our plugin under a ``VLLM_PLUGINS`` value (not a KV rule; pure too)."""

from __future__ import annotations

# ------------------------------------------------------------------ plugin allow-list

PLUGIN_NAME = "dsv4_patch"  # our vllm.general_plugins entry point


def plugin_allowed(vllm_plugins: str | None) -> bool:
    """Whether vLLM loads our plugin under this ``VLLM_PLUGINS`` value (None = unset).

    Parsed exactly as vLLM does (``vllm/envs.py``: ``os.environ["VLLM_PLUGINS"].split(",")``,
    no stripping): ``"other, dsv4_patch"`` does not load it, so it is not allowed here either.
    """
    return vllm_plugins is None or PLUGIN_NAME in vllm_plugins.split(",")
