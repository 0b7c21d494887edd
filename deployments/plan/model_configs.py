"""Where a model's ``config.json`` is found (never downloaded), and the one reader of it.

Plan, doctor and k8s rendering find it here; every reader gets the flat form vLLM's
model code sees (``rules.flatten_config``: a published nested V4.1 config and its flat
form give the same plan).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deployments.config import AppArgs, ConfigError
from dsv4_patch import rules


def find_model_config(args: AppArgs, config_path: Path,
                      override: Path | None = None) -> dict[str, Any]:
    """The model's ``config.json``: --model-config, the tiny model, a local
    directory, or ``configs/models/<model_source>/config.json`` next to CONFIG."""
    if override is not None:
        return _read_json(override)
    loading = args.llm.model_loading_config
    if loading.is_tiny:
        from dsv4_patch.tiny_model import tiny_config
        from dsv4_patch.tiny_tokenizer import TOKENIZER_VOCAB_SIZE

        return tiny_config(TOKENIZER_VOCAB_SIZE)
    source = loading.model_source or loading.model_id
    path, candidates = config_json_path(str(source), config_path.resolve().parent / "models")
    if path is not None:
        return _read_json(path)
    raise ConfigError(
        f"model_source={source!r}: no config.json found (looked in "
        f"{', '.join(str(c) for c in candidates)}). Fix: pass --model-config PATH or "
        "add the model's config.json under configs/models/<model_source>/."
    )


def config_json_path(source: str, *roots: Path) -> tuple[Path | None, list[Path]]:
    """The ``config.json`` of ``source`` (a directory, or ``<root>/<source>/``), and
    every place looked (for the error)."""
    candidates = [Path(source) / "config.json", *(Path(r) / source / "config.json"
                                                  for r in roots)]
    return next((c for c in candidates if c.is_file()), None), candidates


MODEL_KEYS = ("hidden_size", "num_hidden_layers", "moe_intermediate_size", "n_routed_experts",
              "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
              "index_n_heads", "index_head_dim", "compress_ratios", "qk_rope_head_dim",
              "vocab_size")


def read_config_json(path: Path) -> dict[str, Any]:
    """A model's ``config.json``, flat as vLLM's model code sees it: the one read of the
    file (plan, doctor, k8s and the replica's byte-model prediction all come here)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read model config {path}: {exc}") from exc
    return rules.flatten_config(raw)


def _read_json(path: Path) -> dict[str, Any]:
    """A DeepSeek-V4/V4.1 ``config.json`` (nested or flat) with every key the planner
    reads, flat."""
    cfg = read_config_json(path)
    missing = [key for key in MODEL_KEYS if key not in cfg]
    if missing:
        raise ConfigError(
            f"model config {path} lacks {', '.join(missing)}: not a DeepSeek-V4 config.json "
            f"(model_type={cfg.get('model_type')!r}). Fix: point --model-config or "
            "model_source at a DeepSeek-V4 model.")
    return cfg
