"""One reader of a model's ``config.json`` shape, and one compute-capability parser.

A published DeepSeek-V4.1 checkpoint nests its text model under ``text_config`` and its
vision tower under ``vision_config``; vLLM's ``DeepseekV41Config``
(``transformers_utils/configs/deepseek_v41.py``, 0.30+) flattens both before any model
code reads them. Every reader here (plan, prediction, self-check, doctor, k8s) reads
the flat form, so a nested file and the flat form give the same answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# DeepseekV41Config's vision fields: (flat name, nested key, vLLM's default).
_VISION_FIELDS = (
    ("vision_n_layers", "num_hidden_layers", 0),
    ("vision_dim", "hidden_size", 1024),
    ("vision_n_heads", "num_attention_heads", 16),
    ("vision_inter_dim", "intermediate_size", 2816),
    ("vision_patch_size", "patch_size", 14),
)


def flatten_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The config as vLLM's model code sees it: nested or flat in, flat out.

    As ``DeepseekV41Config.__init__``: ``text_config`` keys (not its ``model_type``) first,
    then the top-level keys over them; ``vision_config`` becomes ``vision_*`` fields.
    A flat config comes back unchanged (copied).
    """
    text = dict(cfg.get("text_config") or {})
    vision = dict(cfg.get("vision_config") or {})
    flat = {k: v for k, v in text.items() if k != "model_type"}
    flat.update({k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")})
    if "vision_config" in cfg:
        for name, key, default in _VISION_FIELDS:
            flat.setdefault(name, vision.get(key, default))
    return flat


def parse_capability(value: Any) -> tuple[int, int] | None:
    """A compute capability from ``"9.0"``, ``9.0``, ``"sm_90"``, ``[9, 0]`` or ``(10, 0)``.

    None stays None. Raises ValueError naming the value and the expected form.
    """
    if value is None or value == "":
        return None
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    text = str(value).strip().lower().removeprefix("sm_").removeprefix("sm")
    major, dot, minor = text.partition(".")
    if not dot and major.isdigit() and len(major) in (2, 3):  # "90", "100", "120"
        major, minor = major[:-1], major[-1]
    if not (major.isdigit() and (minor or "0").isdigit()):
        raise ValueError(
            f"compute_capability={value!r}: expected MAJOR.MINOR such as \"9.0\" "
            "(H100/H200), \"10.0\" (B200) or \"12.0\" (RTX 50xx).")
    return int(major), int(minor or 0)
