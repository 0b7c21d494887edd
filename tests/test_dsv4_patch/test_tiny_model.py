"""The tiny DeepSeek-V4 directory: deterministic, Flash-shaped, within vLLM-CPU limits.

No engine here (see test_engine_generation.py); these run in a second or two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_patch import rules, tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
FLASH_CONFIG = REPO / "configs/models/deepseek-ai/DeepSeek-V4-Flash/config.json"

# docs/design.md, section 4: what vLLM-CPU 0.32.0's DeepSeek-V4 kernels accept.
CPU_ROUTED_EXPERTS = {64, 128, 256, 384}
CPU_TOP_K = {6, 8}

# Keys Flash has that the tiny model leaves out on purpose: CPU fp8 block GEMMs need
# AMX, so the tiny model is unquantized bf16; transformers_version is provenance only.
OMITTED_FLASH_KEYS = {"quantization_config", "transformers_version"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.ensure_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text("utf-8"))


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def _cli_build(path: Path, hash_seed: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    return subprocess.run(
        [sys.executable, "-m", "deployments.cli", "tiny-model", str(path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=True,
    )


def test_cli_builds_byte_identical_directories(tmp_path: Path) -> None:
    """Two separate processes (different hash seeds) write the same bytes."""
    a, b = tmp_path / "a", tmp_path / "b"
    out = _cli_build(a, "1")
    _cli_build(b, "2")
    assert out.stdout.strip() == str(a.resolve())
    files_a, files_b = _files(a), _files(b)
    assert set(files_a) == {
        "config.json", "generation_config.json", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json", tiny_model.STAMP_FILE,
    }
    assert files_a == files_b


def test_ensure_builds_once_and_rebuilds_when_stale(tmp_path: Path) -> None:
    path = tmp_path / "m"
    first = tiny_model.ensure_tiny_model(path)
    inode = (first / "config.json").stat().st_ino
    assert tiny_model.ensure_tiny_model(path) == first
    assert (first / "config.json").stat().st_ino == inode, "fresh directory was rebuilt"

    stamp = first / tiny_model.STAMP_FILE
    stamp.write_text(json.dumps({"input_digest": "from-an-older-builder"}))
    assert not tiny_model.is_fresh(first)
    tiny_model.ensure_tiny_model(path)
    assert tiny_model.is_fresh(first)
    assert (first / "config.json").stat().st_ino != inode
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".m.")]
    assert leftovers == [".m.lock"], f"temp build dirs left behind: {leftovers}"


def test_refuses_to_overwrite_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"not a tiny model directory.*Choose another PATH"):
        tiny_model.ensure_tiny_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_default_path_honours_cache_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(tiny_model.CACHE_ENV, str(tmp_path))
    assert tiny_model.default_path() == tmp_path / tiny_model.TINY_MODEL_NAME
    monkeypatch.delenv(tiny_model.CACHE_ENV)
    assert tiny_model.default_path() == Path.home() / ".cache/dsv4-serve/dsv4-tiny"


def test_config_mirrors_flash_keys(config: dict) -> None:
    flash = json.loads(FLASH_CONFIG.read_text("utf-8"))
    missing = set(flash) - OMITTED_FLASH_KEYS - set(config)
    assert not missing, f"tiny config lacks Flash keys {sorted(missing)}"
    for key in ("architectures", "model_type", "hc_mult", "o_groups", "sliding_window",
                "scoring_func", "topk_method", "num_key_value_heads", "bos_token_id",
                "eos_token_id", "n_shared_experts", "num_nextn_predict_layers"):
        assert config[key] == flash[key], key


def test_config_within_cpu_kernel_limits(config: dict) -> None:
    assert config["n_routed_experts"] in CPU_ROUTED_EXPERTS
    assert config["num_experts_per_tok"] in CPU_TOP_K
    assert config["index_topk"] == 512
    assert config["head_dim"] == 512
    assert config["qk_rope_head_dim"] == 64
    assert config["index_head_dim"] == 128  # the CPU compressor takes 512 or 128
    assert config["num_attention_heads"] >= 64  # 16 heads are rejected on CPU
    assert config["num_attention_heads"] % config["o_groups"] == 0
    assert "quantization_config" not in config


def test_layer_pattern_has_swa_c4_c128_and_hash_layers(config: dict) -> None:
    shape = rules.ModelShape.from_hf_config(config)
    assert shape.layers_with_ratio(0) >= 1, "no SWA-only layer"
    assert shape.layers_with_ratio(4) >= 1, "no C4 (indexer) layer"
    assert shape.layers_with_ratio(128) >= 1, "no C128 layer"
    n = config["num_hidden_layers"]
    assert len(config["compress_ratios"]) == n + config["num_nextn_predict_layers"]
    assert 0 < config["num_hash_layers"] < n, "need hash-routed and gate-routed MoE layers"
    hashed = set(config["compress_ratios"][: config["num_hash_layers"]])
    assert {0, 4} <= hashed, "hash routing should cover an SWA-only and a C4 layer"


def test_vocab_size_matches_tokenizer(config: dict, hf_tokenizer) -> None:
    # Random weights may sample any id: every id must exist in the tokenizer.
    assert len(hf_tokenizer) == config["vocab_size"] == tiny_tokenizer.TOKENIZER_VOCAB_SIZE


def test_tokenizer_round_trips_text(hf_tokenizer) -> None:
    text = "Serve DeepSeek-V4: 3915 B/token, ¿qué? 你好 🙂\n\tdef f(x): return x**2"
    ids = hf_tokenizer(text).input_ids
    assert ids[0] == 0, "BOS must be prepended for add_special_tokens=True"
    assert hf_tokenizer.decode(ids[1:]) == text
    assert len(ids) < len(text.encode()), "BPE merges did not shorten the text"


def test_special_tokens_are_single_ids(hf_tokenizer) -> None:
    for token, special in tiny_tokenizer.MARKER_TOKENS:
        ids = hf_tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1, f"{token!r} splits into {ids}"
        decoded = hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert decoded == ("" if special else token), token
    assert hf_tokenizer.bos_token_id == 0 and hf_tokenizer.eos_token_id == 1
    assert hf_tokenizer.convert_ids_to_tokens([0, 1]) == [
        tiny_tokenizer.BOS_TOKEN, tiny_tokenizer.EOS_TOKEN,
    ]


CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Bye"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_deepseek_v4_chat_encoding(hf_tokenizer, messages) -> None:
    """The Jinja template (tokenizer_mode=hf) renders what vLLM's DSv4 encoder renders."""
    from vllm.tokenizers.deepseek_v4_encoding import encode_messages

    rendered = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered == encode_messages(messages, thinking_mode="chat")
    assert rendered.endswith(tiny_tokenizer.ASSISTANT_TOKEN + tiny_tokenizer.THINK_END_TOKEN)


def test_vllm_deepseek_v4_tokenizer_encodes_chat(model_dir: Path) -> None:
    """vLLM's tokenizer_mode=deepseek_v4 loads the files and finds every marker as one id."""
    from vllm.tokenizers.deepseek_v4 import DeepseekV4Tokenizer

    tok = DeepseekV4Tokenizer.from_pretrained(str(model_dir))
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    vocab = tok.get_vocab()
    assert ids[0] == vocab[tiny_tokenizer.BOS_TOKEN]
    assert ids[-1] == vocab[tiny_tokenizer.THINK_START_TOKEN]  # thinking mode is the default
    assert vocab[tiny_tokenizer.USER_TOKEN] in ids and vocab[tiny_tokenizer.ASSISTANT_TOKEN] in ids
    chat_ids = tok.apply_chat_template(
        [{"role": "user", "content": "Hello"}], enable_thinking=False
    )
    assert chat_ids[-2:] == [
        vocab[tiny_tokenizer.ASSISTANT_TOKEN], vocab[tiny_tokenizer.THINK_END_TOKEN]
    ]

