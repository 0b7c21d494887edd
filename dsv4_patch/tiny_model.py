"""A tiny random-weight DeepSeek-V4 that a 2-core CPU box can boot and generate with.

Why it exists: CI and a new user without GPUs must run the production stack (a real
vLLM engine on the real ``DeepseekV4ForCausalLM`` architecture, ``kv_cache_dtype=auto``,
the fp8_ds_mla KV cache) without downloading 150 GB of weights. The directory holds a
``config.json`` that mirrors DeepSeek-V4-Flash's *structure* (SWA-only, C4 and C128
layers, the indexer, hash-routed MoE layers, shared + routed experts, hyper-connections,
grouped output projection, fp8 block quantization) at a size that fits vLLM-CPU's
kernel limits, and a byte-level BPE tokenizer trained deterministically from
``data/tiny_corpus.txt``. There are no weights: serve it with ``load_format="dummy"``.

The same inputs always produce byte-identical files, and ``ensure_tiny_model`` builds
the directory once per input digest, atomically, so concurrent processes (pytest
workers, Serve replicas) never read half a directory.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dsv4_patch.tiny_tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    MARKER_TOKENS,
    PAD_TOKEN,
    TOKENIZER_VOCAB_SIZE,
    read_corpus,
    tokenizer_config,
    tokenizer_size,
    train_tokenizer,
)

# The tiny model's one name: the ``model_source`` alias in configs, the OpenAI ``model``
# it is served under, and its directory name.
TINY_MODEL_NAME = "dsv4-tiny"
# Bump when the builder changes what it writes; part of the staleness digest.
FORMAT_VERSION = 1
# File written last into the directory: its presence means "complete", its digest
# means "built from these inputs".
STAMP_FILE = "dsv4-tiny-model.json"
CACHE_ENV = "DSV4_SERVE_CACHE"
DEFAULT_CACHE = Path("~/.cache/dsv4-serve")

# Flash: 2 SWA-only layers, then C4/C128 alternating, plus one SWA-only MTP layer.
# Tiny: the same pattern cut to 4 layers (+1 MTP entry): SWA, C4, C128, C4.
COMPRESS_RATIOS = (0, 4, 128, 4, 0)
NUM_HIDDEN_LAYERS = 4
NUM_NEXTN_PREDICT_LAYERS = 1


def tiny_config(vocab_size: int) -> dict[str, Any]:
    """The tiny ``config.json``: Flash's keys and structure, small where vLLM-CPU allows.

    Values pinned by vLLM-CPU's kernels (docs/design.md, section 4) stay at Flash's size:
    head_dim 512, rope 64, index_head_dim 128, index_topk 512, top-k 6 of 64 routed
    experts. The rest (hidden size, LoRA ranks, heads, expert width, layer count) is
    shrunk so the engine boots in well under a minute on 2 cores.
    """
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hc_eps": 1e-06,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "head_dim": 512,
        "hidden_act": "silu",
        "hidden_size": 256,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "index_topk": 512,
        "initializer_range": 0.02,
        "max_position_embeddings": 65536,
        "moe_intermediate_size": 128,
        "n_routed_experts": 64,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 64,
        "num_experts_per_tok": 6,
        "num_hidden_layers": NUM_HIDDEN_LAYERS,
        "num_hash_layers": 2,
        "num_key_value_heads": 1,
        "num_nextn_predict_layers": NUM_NEXTN_PREDICT_LAYERS,
        "o_groups": 8,
        "o_lora_rank": 256,
        "q_lora_rank": 256,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 16,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "sliding_window": 128,
        "swiglu_limit": 10.0,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab_size,
        "compress_rope_theta": 160000,
        "compress_ratios": list(COMPRESS_RATIOS),
    }



def _dump(obj: Any) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, sort_keys=True, indent=2) + "\n").encode()


def input_digest() -> str:
    """Digest of everything the files depend on; a changed digest means rebuild.

    Includes the ``tokenizers`` version because BPE training is deterministic per
    library version, not across versions.
    """
    import tokenizers

    h = hashlib.sha256()
    for part in (
        str(FORMAT_VERSION),
        tokenizers.__version__,
        str(TOKENIZER_VOCAB_SIZE),
        json.dumps(MARKER_TOKENS, ensure_ascii=False),
        json.dumps(tiny_config(0), sort_keys=True),
        json.dumps(tokenizer_config(), sort_keys=True, ensure_ascii=False),
        read_corpus(),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def build_files() -> dict[str, bytes]:
    """Every file of the model directory, name -> exact bytes (stamp excluded)."""
    tokenizer_json = train_tokenizer(read_corpus())
    vocab_size = tokenizer_size(tokenizer_json)
    return {
        "config.json": _dump(tiny_config(vocab_size)),
        "generation_config.json": _dump({"bos_token_id": 0, "eos_token_id": 1}),
        "tokenizer.json": tokenizer_json.encode(),
        "tokenizer_config.json": _dump(tokenizer_config()),
        "special_tokens_map.json": _dump(
            {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
        ),
    }



def default_path() -> Path:
    """``$DSV4_SERVE_CACHE/dsv4-tiny`` (cache defaults to ``~/.cache/dsv4-serve``)."""
    cache = os.environ.get(CACHE_ENV) or str(DEFAULT_CACHE)
    return Path(cache).expanduser() / TINY_MODEL_NAME


def read_stamp(path: Path) -> dict[str, Any] | None:
    """The stamp of a built directory, or None if absent (not built, or not ours)."""
    stamp = path / STAMP_FILE
    if not stamp.is_file():
        return None
    return json.loads(stamp.read_text("utf-8"))


def is_fresh(path: Path, digest: str | None = None) -> bool:
    """True when ``path`` is a complete tiny model built from the current inputs."""
    stamp = read_stamp(path)
    return stamp is not None and stamp.get("input_digest") == (digest or input_digest())


@contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Serialize builders of one directory across processes (flock on a sibling file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.parent / f".{path.name}.lock"
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _check_replaceable(path: Path) -> None:
    """Refuse to replace a non-empty directory that this builder did not write."""
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not read_stamp(path))):
        raise FileExistsError(
            f"tiny-model path {str(path)!r} exists and is not a tiny model directory "
            f"(no {STAMP_FILE}); expected a missing, empty or previously built directory. "
            "Choose another PATH or remove it."
        )


def write_model(path: Path, digest: str) -> None:
    """Build into a temp dir next to ``path`` and rename it into place.

    The stamp is written last inside the temp dir, and the rename is atomic, so a
    reader either sees no directory, the old complete one, or the new complete one.
    """
    _check_replaceable(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.build-", dir=path.parent))
    try:
        for name, content in build_files().items():
            (tmp / name).write_bytes(content)
        stamp = {"name": TINY_MODEL_NAME, "format_version": FORMAT_VERSION,
                 "input_digest": digest}
        (tmp / STAMP_FILE).write_bytes(_dump(stamp))
        os.chmod(tmp, 0o755)  # noqa: S103  # an executable script of our own
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.rename(path, old / "model")
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.rename(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def ensure_tiny_model(path: Path | None = None, *, force: bool = False) -> Path:
    """Return a complete, current tiny-model directory, building it only if needed.

    ``path`` defaults to ``$DSV4_SERVE_CACHE/dsv4-tiny``. Cheap when fresh
    (one digest over small inputs, no tokenizer training).
    """
    target = (path or default_path()).expanduser().resolve()
    digest = input_digest()
    if not force and is_fresh(target, digest):
        return target
    with _build_lock(target):
        if force or not is_fresh(target, digest):
            write_model(target, digest)
    return target


# How the tiny model is served on CPU (docs/design.md, section 4): 1 GiB of KV cache, no OMP
# thread pinning (2 cores shared with the test runner), eager mode.
CPU_ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}

def cpu_engine_kwargs(path: str | Path, **overrides: Any) -> dict[str, Any]:
    """``vllm.LLM``/engine arguments that serve the tiny model on CPU.

    ``kv_cache_dtype="auto"`` on purpose: it is the setting this project fixes, and on
    CPU it resolves to the fp8_ds_mla layout in the workers.
    """
    kwargs: dict[str, Any] = {
        "model": str(path),
        "served_model_name": TINY_MODEL_NAME,
        "load_format": "dummy",
        "kv_cache_dtype": "auto",
        "enforce_eager": True,
        "max_model_len": 4096,
        "seed": 0,
    }
    kwargs.update(overrides)
    return kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``dsv4-serve tiny-model``."""
    parser.add_argument(
        "path", nargs="?", type=Path, default=None,
        help=f"output directory (default: ${CACHE_ENV}/{TINY_MODEL_NAME}, "
        f"{CACHE_ENV} defaulting to {DEFAULT_CACHE})",
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if the directory is current"
    )


def main(args: argparse.Namespace) -> int:
    """Build (or confirm) the tiny model and print its path for scripts to use."""
    path = ensure_tiny_model(args.path, force=args.force)
    config = json.loads((path / "config.json").read_text("utf-8"))
    print(
        f"{TINY_MODEL_NAME}: {path} (layers={config['num_hidden_layers']}, "
        f"compress_ratios={config['compress_ratios']}, vocab={config['vocab_size']}); "
        'serve with load_format="dummy"',
        file=sys.stderr,
    )
    print(path)
    return 0
