"""A tiny servable model directory, built offline for the server tests.

The chat model of tests/tiny_chat_model.py (byte-level BPE with role special tokens and a chat
template, random DeepSeek-V2 weights of that vocabulary), plus what ``irminsul serve --model DIR``
reads on top: a generation_config.json naming the stop tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_chat_model import BOS, END, EOS, random_model, sentences, write_tokenizer

__all__ = ["BOS", "END", "EOS", "build", "plain_ids", "sentences"]


def plain_ids(directory: Path) -> list[int]:
    """Ids that decode, alone, to printable ASCII (no special token, no partial UTF-8 byte)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    texts = [tokenizer.decode([i], skip_special_tokens=True)
             for i in range(tokenizer.get_vocab_size())]
    return [i for i, text in enumerate(texts) if text and text.isascii() and text.isprintable()]


def build(directory: Path, *, layers: int = 2, seed: int = 0) -> Path:
    """The model directory: tokenizer files, random weights, stop tokens <|eos|> and <|end|>."""
    from tokenizers import Tokenizer

    vocab_size = write_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in (BOS, EOS, END)}
    model = random_model(vocab_size, layers=layers, seed=seed, bos_token_id=ids[BOS],
                         eos_token_id=ids[EOS], pad_token_id=ids[EOS])
    with torch.no_grad():
        # Only printable-ASCII tokens get logits away from 0, so greedy output is readable text
        # (stop strings can be picked from it) and never ends early at a stop token.
        others = sorted(set(range(vocab_size)) - set(plain_ids(directory)))
        model.lm_head.weight[others] = 0
    model.save_pretrained(directory)
    generation = {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[END]]}
    (directory / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    return directory
