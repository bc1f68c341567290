"""A tiny servable model directory, built offline for the server tests.

A byte-level BPE (about 300 ids: the 256 byte symbols, a few merges, special tokens for the roles
and the end of a turn) with a chat template in tokenizer_config.json, random DeepSeek-V2 weights of
that vocabulary written by transformers, and a generation_config.json naming the stop tokens, which
is what ``irminsul serve --model DIR`` reads.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tiny_models import BASE, CASES

BOS, EOS, END = "<|bos|>", "<|eos|>", "<|end|>"
ROLES = ("system", "user", "assistant", "tool")
# Role tokens and the turn end are special, so BPE never merges across a message edge and each
# message tokenises the same wherever it lands (the renderer and message-aligned chunking rely on
# it).
SPECIALS = [BOS, EOS, END, *(f"<|{role}|>" for role in ROLES)]
TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message.role }}|>"
            "{{ message.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = ("the flight from boston to denver leaves at noon and arrives late in the evening "
         "passenger booking seat baggage refund change cancel policy agent tool file code "
         "function return value error test patch python module import class method").split()


def sentences(n: int, seed: int) -> list[str]:
    """``n`` reproducible random sentences over WORDS."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12))).capitalize() + "."
            for _ in range(n)]


def write_tokenizer(directory: Path, vocab_size: int = 300) -> dict[str, int]:
    """Train the BPE, save tokenizer.json + tokenizer_config.json; return the special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(sentences(300, seed=1), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return {token: tokenizer.token_to_id(token) for token in SPECIALS} | {
        "vocab_size": tokenizer.get_vocab_size()}


def plain_ids(directory: Path) -> list[int]:
    """Ids that decode, alone, to printable ASCII (no special token, no partial UTF-8 byte)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    texts = [tokenizer.decode([i], skip_special_tokens=True)
             for i in range(tokenizer.get_vocab_size())]
    return [i for i, text in enumerate(texts) if text and text.isascii() and text.isprintable()]


def build(directory: Path, *, layers: int = 2, seed: int = 0) -> Path:
    """The model directory: tokenizer files, random weights, stop tokens <|eos|> and <|end|>."""
    import transformers

    ids = write_tokenizer(directory)
    family, overrides = CASES["v2_lite_like"]
    cfg = {**BASE, **overrides, "vocab_size": ids["vocab_size"], "num_hidden_layers": layers,
           "first_k_dense_replace": min(1, layers - 1), "bos_token_id": ids[BOS],
           "eos_token_id": ids[EOS], "pad_token_id": ids[EOS]}
    config = getattr(transformers, f"{family}Config")(**cfg)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)  # far from the init's near-uniform logits: clear greedy choices
        # Only printable-ASCII tokens get logits away from 0, so greedy output is readable text
        # (stop strings can be picked from it) and never ends early at a stop token.
        others = sorted(set(range(ids["vocab_size"])) - set(plain_ids(directory)))
        model.lm_head.weight[others] = 0
    model.save_pretrained(directory)
    generation = {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOS], ids[END]]}
    (directory / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    return directory
