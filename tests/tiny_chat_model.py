"""A tiny chat model directory built offline: a byte-level BPE tokenizer with a chat template and
random DeepSeek-V2 weights written by transformers, plus a small workload that reuses documents at
shifted positions.

Everything is generated here (no downloads): the tokenizer is trained on sentences drawn from a
fixed word list, so documents built from the same words tokenise compactly.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tiny_models import BASE, CASES

from irminsul.cache.markers import MARKER_TEXT

BOS, EOS, END = "<|bos|>", "<|eos|>", "<|end|>"
ROLES = ("system", "user", "assistant", "tool", "developer")
# Role tokens and the message end are special tokens, so BPE never merges across a message edge
# and each message renders to the same tokens wherever it lands (the renderer relies on it).
SPECIALS = [BOS, EOS, END, *(f"<|{role}|>" for role in ROLES)]
# Incremental: messages[:i+1] renders to messages[:i]'s text plus message i's own piece.
TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message.role }}|>"
            "{{ message.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")

WORDS = ("the flight from boston to denver leaves at noon and arrives late in the evening "
         "passenger booking reservation cabin economy business seat baggage refund change cancel "
         "policy agent user tool file code function return value error test patch repository "
         "python module import class method argument list string number date time gate crew "
         "weather delay route airport ticket price fare member gold silver basic insurance").split()


def sentences(n: int, seed: int, words: int = 12) -> list[str]:
    """``n`` random sentences over WORDS, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(words // 2, words))).capitalize()
            + "." for _ in range(n)]


def write_tokenizer(directory: Path, *, vocab_size: int = 400) -> int:
    """Train a byte-level BPE and save tokenizer.json + tokenizer_config.json (with the chat
    template); returns the tokenizer's vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = sentences(400, seed=1) + [MARKER_TEXT] * 20  # the S2 marker merges to a few tokens
    tokenizer.train_from_iterator(lines, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return tokenizer.get_vocab_size()


def random_model(vocab_size: int, *, layers: int = 1, seed: int = 0, **config):
    """A random DeepSeek-V2 (YaRN rope, as tests/tiny_models.py's v2_lite_like), weights re-drawn
    from N(0, 0.2) — far from the init's near-uniform logits, so argmaxes are clear."""
    import transformers

    family, overrides = CASES["v2_lite_like"]
    cfg = {**BASE, **overrides, "vocab_size": vocab_size, "num_hidden_layers": layers,
           "first_k_dense_replace": min(1, layers - 1), **config}
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(
        getattr(transformers, f"{family}Config")(**cfg)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def build(directory: Path, *, layers: int = 1, seed: int = 0, vocab_size: int | None = None,
          tokenizer: bool = True) -> Path:
    """A model directory: tokenizer files (unless ``tokenizer`` is False) and random weights with
    the tokenizer's vocabulary (or ``vocab_size``)."""
    size = write_tokenizer(directory) if tokenizer else 0
    random_model(vocab_size or size or 400, layers=layers, seed=seed).save_pretrained(directory)
    return directory


def documents(n: int, seed: int = 7) -> list[str]:
    """``n`` distinct documents of about 60-100 tokens each."""
    return [" ".join(sentences(4, seed=seed * 100 + i)) for i in range(n)]


def workload() -> list[dict]:
    """Eight chat requests: later ones resend earlier documents reordered, behind a system prompt
    of another length, or inside one message between S2 markers, so the planner finds PIC hits
    (message-aligned chunking or marker edges) as well as exact prefixes and novel text."""
    docs = documents(6)
    sys_a, sys_b = " ".join(sentences(3, seed=11)), " ".join(sentences(6, seed=12))
    ask = sentences(8, seed=13)

    def req(session: str, call: int, system: str, parts: list[str], question: str) -> dict:
        messages = [{"role": "system", "content": system}]
        messages += [{"role": "user", "content": part} for part in parts]
        messages.append({"role": "user", "content": question})
        return {"session": session, "call": call, "messages": messages}

    first = req("a", 0, sys_a, [docs[0], docs[1]], ask[0])
    follow_up = dict(first, call=1, messages=first["messages"] + [
        {"role": "assistant", "content": sentences(1, seed=14)[0]},
        {"role": "user", "content": ask[1]}])
    marked = f"{ask[6]}{MARKER_TEXT}{docs[5]}{MARKER_TEXT}"
    return [
        first,
        follow_up,  # exact prefix of the first, novel tail
        req("b", 0, sys_b, [docs[1], docs[0]], ask[2]),  # both documents shifted and reordered
        req("c", 0, sys_a, [docs[2], docs[0], docs[3]], ask[3]),  # docs[0] shifted
        req("d", 0, sys_b, [docs[3], docs[2], docs[1]], ask[4]),
        req("e", 0, sys_a, [docs[4]], marked),  # a shared region between markers
        req("f", 0, sys_b, [docs[4], f"{ask[7]} {ask[5]}{MARKER_TEXT}{docs[5]}{MARKER_TEXT}"],
            ask[5]),  # the marked region again, after text of another length
        req("g", 0, sys_a, [docs[5]], ask[7]),  # nothing shared past the system prompt
    ]

