"""The embedded default model's tokenizer: a byte-level BPE trained here and its chat template.

Role tokens, the message end, the tool block and tool calls are special tokens, so BPE never
merges across a message edge and each message renders to the same tokens wherever it lands (the
renderer, irminsul.traffic.render.ChatRenderer, relies on it). The template is incremental:
messages[:i+1] renders to messages[:i]'s text plus message i's piece. Tool schemas follow the first
message (the system prompt), as in the DeepSeek-V3.1 template, inside that message's piece.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from irminsul.cache.markers import MARKER_TEXT

BOS, EOS, END = "<|bos|>", "<|eos|>", "<|end|>"
TOOLS, TOOL_CALL = "<|tools|>", "<|tool_call|>"
ROLES = ("system", "user", "assistant", "tool", "developer")
SPECIALS = [BOS, EOS, END, TOOLS, TOOL_CALL, *(f"<|{role}|>" for role in ROLES)]
# Text after a block tag sits inside {{ }} so the renderer's trim_blocks cannot eat its newlines.
TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{{ '<|' + message.role + '|>' + message.content }}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    "{{ '<|tool_call|>' + call.function.name + '\\n' + call.function.arguments }}"
    "{%- endfor %}{%- endif %}"
    "{{ '<|end|>' }}"
    "{%- if loop.first and tools %}{{ '<|tools|>' }}"
    "{%- for tool in tools %}"
    "{{ '### ' + tool.function.name + '\\n' + (tool.function.description or '')"
    " + '\\nParameters: ' + (tool.function.parameters | tojson) + '\\n\\n' }}"
    "{%- endfor %}{{ '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# Generation stops at the end of the assistant's message (or of a whole document).
STOP_TOKENS = (END, EOS)

# The prompts the model card's greedy samples come from (evaluate_default_model.py), also
# rendered into the retrain's agent data (agent_corpus.py) so its figures compare.
CHAT_PROMPTS = [
    [{"role": "system", "content": "You are a helpful airline customer service agent."},
     {"role": "user", "content": "Hi, I want to change my flight reservation to a later date."}],
    [{"role": "system", "content": "You are a helpful assistant that can interact with a computer "
                                   "to solve tasks."},
     {"role": "user", "content": "Please fix the failing test in the repository."}],
    [{"role": "user", "content": "How do I read a JSON file in Python?"}],
]
CODE_PROMPTS = ["import os\nimport sys\n\n\ndef main(", "class Queue:\n    \"\"\"A first-in,",
                "def parse_args(argv):\n    parser = argparse."]

def train_tokenizer(texts: Iterable[str], directory: Path, *, vocab_size: int = 8192) -> int:
    """Train the byte-level BPE on ``texts`` (plus the S2 marker, so that it merges to a few
    tokens) and save tokenizer.json + tokenizer_config.json; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)

    def corpus() -> Iterable[str]:
        yield from texts
        yield from [MARKER_TEXT] * 1000

    tokenizer.train_from_iterator(corpus(), trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "chat_template": TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast",
              "add_bos_token": False, "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1), "utf-8")
    return tokenizer.get_vocab_size()
