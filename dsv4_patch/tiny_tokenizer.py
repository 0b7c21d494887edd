"""The tiny model's tokenizer: DeepSeek's marker tokens, the chat template, a byte-level BPE.

Kept apart from ``tiny_model`` (which writes the directory) because the tokenizer is
its own job: vocabulary, markers vLLM's DeepSeek-V4 renderer and parsers look up, and
deterministic training from ``data/tiny_corpus.txt``.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

CORPUS_RESOURCE = "tiny_corpus.txt"

# Byte-level BPE target size; the corpus reaches it, so the config's vocab_size equals
# the tokenizer's size exactly (random weights may sample any id; every id decodes).
TOKENIZER_VOCAB_SIZE = 1024

BOS_TOKEN = "<｜begin▁of▁sentence｜>"  # noqa: S105  # a special token, not a password
EOS_TOKEN = "<｜end▁of▁sentence｜>"  # noqa: S105  # a special token, not a password
PAD_TOKEN = "<｜▁pad▁｜>"  # noqa: S105  # a special token, not a password
USER_TOKEN = "<｜User｜>"  # noqa: S105  # a special token, not a password
ASSISTANT_TOKEN = "<｜Assistant｜>"  # noqa: S105  # a special token, not a password
THINK_START_TOKEN = "<think>"  # noqa: S105  # a special token, not a password
THINK_END_TOKEN = "</think>"  # noqa: S105  # a special token, not a password

# (token, special). Ids follow this order, so BOS=0 and EOS=1 as in DeepSeek-V4. These
# are the markers vLLM's DeepSeek-V4 chat encoding, renderer (FIM) and reasoning/tool
# parser emit or look up as single tokens. Only BOS/EOS/PAD are "special" (stripped by
# skip_special_tokens); the rest stay visible in decoded text so the reasoning and
# tool-call parsers can see them, as in DeepSeek's own tokenizers.
MARKER_TOKENS: tuple[tuple[str, bool], ...] = (
    (BOS_TOKEN, True),
    (EOS_TOKEN, True),
    (PAD_TOKEN, True),
    (USER_TOKEN, False),
    (ASSISTANT_TOKEN, False),
    (THINK_START_TOKEN, False),
    (THINK_END_TOKEN, False),
    ("<｜latest_reminder｜>", False),
    ("<｜action｜>", False),
    ("<｜query｜>", False),
    ("<｜authority｜>", False),
    ("<｜domain｜>", False),
    ("<｜title｜>", False),
    ("<｜read_url｜>", False),
    ("<｜fim▁begin｜>", False),
    ("<｜fim▁hole｜>", False),
    ("<｜fim▁end｜>", False),
    ("｜DSML｜", False),
)

# DeepSeek-V4's chat format in "chat" (non-thinking) mode as a Jinja template, for
# clients that use tokenizer_mode=hf. vLLM's tokenizer_mode=deepseek_v4 ignores it and
# applies DeepSeek's own encoder; tests check both agree on plain conversations.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set next_role = messages[loop.index0 + 1]['role'] if not loop.last else none -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}"
    "{{ '" + USER_TOKEN + "' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ message['content'] + '" + EOS_TOKEN + "' }}"
    "{%- endif -%}"
    "{%- if message['role'] in ['system', 'user'] and (next_role == 'assistant'"
    " or (loop.last and add_generation_prompt)) -%}"
    "{{ '" + ASSISTANT_TOKEN + THINK_END_TOKEN + "' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def read_corpus() -> str:
    """The tokenizer's training text, shipped as package data so wheels carry it."""
    data = resources.files("dsv4_patch").joinpath("data")
    return data.joinpath(CORPUS_RESOURCE).read_text("utf-8")


def train_tokenizer(corpus: str, vocab_size: int = TOKENIZER_VOCAB_SIZE) -> str:
    """Train a byte-level BPE on ``corpus`` and return its ``tokenizer.json`` text.

    Byte-level so any text round-trips; markers are added tokens with fixed ids
    0..N-1 (BOS=0, EOS=1); a post-processor prepends BOS, as DeepSeek's tokenizer
    does for ``add_special_tokens=True``. Output is canonical JSON (sorted keys) so
    identical inputs give identical bytes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[token for token, _ in MARKER_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([corpus], trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, 0)],
    )
    data = json.loads(tokenizer.to_str())
    special = dict(MARKER_TOKENS)
    for entry in data["added_tokens"]:
        entry["special"] = special[entry["content"]]
    return json.dumps(data, ensure_ascii=False, sort_keys=True, indent=1) + "\n"


def tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens, the chat template, the fast class."""
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 65536,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }



def tokenizer_size(tokenizer_json: str) -> int:
    """Number of ids (BPE vocab + added tokens): the config's ``vocab_size``."""
    data = json.loads(tokenizer_json)
    ids = set(data["model"]["vocab"].values()) | {t["id"] for t in data["added_tokens"]}
    if ids != set(range(len(ids))):
        raise RuntimeError(
            f"tokenizer ids are not contiguous 0..{len(ids) - 1}; the tiny model's "
            "vocab_size would not match the tokenizer. Fix MARKER_TOKENS/the trainer."
        )
    return len(ids)
