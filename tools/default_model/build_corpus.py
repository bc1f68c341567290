"""Build the embedded default model's training corpus and tokenizer, offline, into ``.train/``.

Sources (openly licensed, on these machines):

- CPython's standard library (``*.py`` under /usr/lib/python3.11, site/dist-packages excluded),
  which includes ``pydoc_data/topics.py``, the language reference text; PSF License 2.0.
- The real agent request logs in /work/shared/traces (tau-bench airline, mini-swe-agent; MIT),
  rendered with the new tokenizer's chat template so the model sees system / user / assistant /
  tool turns and tool schemas. A log re-sends the whole history on every call, so only each
  session's longest request is kept (it holds every earlier call's messages).

Writes ``tokenizer/`` (tokenizer.json, tokenizer_config.json), ``train.bin`` and ``val.bin``
(uint16 token ids, documents back to back, each opened by BOS and closed by EOS),
``train.starts.npy`` / ``val.starts.npy`` (document start offsets) and ``manifest.json``. The
validation split is held out by document (fixed seed), per source. Only this script reads
/work/shared; the rest of the repository works without it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, not installed

from chat_format import BOS, EOS, TEMPLATE, train_tokenizer  # noqa: E402

from irminsul.traffic.logs import Request, read_requests  # noqa: E402
from irminsul.traffic.render import ChatRenderer  # noqa: E402

LOGS = {"tau-bench": "tau-bench-airline.requests.jsonl.xz",
        "mini-swe-agent": "mini-swe-agent-gemini3pro.requests.jsonl.xz"}
TOKENIZER_SAMPLE_CHARS = 12_000_000  # of agent text, beside the whole standard library


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's Python files, sorted; third-party packages left out."""
    return sorted(p for p in root.rglob("*.py")
                  if not {"site-packages", "dist-packages", "__pycache__"} & set(p.parts))


def last_requests(path: Path) -> list[Request]:
    """Each session's longest request (the latest on a tie), in first-seen session order."""
    best: dict[str, Request] = {}
    for request in read_requests(path):
        kept = best.get(request.session)
        if kept is None or len(request.messages) >= len(kept.messages):
            best[request.session] = request
    return list(best.values())


def message_texts(requests: list[Request]) -> Iterator[str]:
    """Every distinct message content and tool schema text of the requests (tokenizer training)."""
    seen: set[str] = set()
    for request in requests:
        parts = [json.dumps(request.tools)] if request.tools else []
        parts += [m["content"] for m in request.messages if isinstance(m.get("content"), str)]
        for text in parts:
            if text not in seen:
                seen.add(text)
                yield text


def encode_documents(renderer: ChatRenderer, texts: list[str]) -> list[np.ndarray]:
    """Plain-text documents as BOS + text + EOS token ids."""
    bos, eos = (renderer.tokenizer.token_to_id(t) for t in (BOS, EOS))
    encodings = renderer.tokenizer.encode_batch(texts, add_special_tokens=False)
    return [np.asarray([bos, *e.ids, eos], dtype=np.uint16) for e in encodings]


def encode_chats(renderer: ChatRenderer, requests: list[Request]) -> list[np.ndarray]:
    """Chat sessions rendered with the chat template (it opens with BOS), then EOS."""
    eos = renderer.tokenizer.token_to_id(EOS)
    return [np.append(renderer.render(r.messages, r.tools, add_generation_prompt=False).tokens,
                      eos).astype(np.uint16) for r in requests]


def split(docs: list[np.ndarray], fraction: float, rng: random.Random,
          ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(train, val): documents in a seeded order go to val until it holds ``fraction`` of the
    tokens (at least one document), the rest to train."""
    order = list(range(len(docs)))
    rng.shuffle(order)
    want, held = fraction * sum(d.size for d in docs), 0
    val: list[np.ndarray] = []
    train: list[np.ndarray] = []
    for i in order:
        if held < want or not val:
            val.append(docs[i])
            held += docs[i].size
        else:
            train.append(docs[i])
    return train, val


def within_budget(docs: list[np.ndarray], budget: int) -> list[np.ndarray]:
    """The leading documents whose tokens fit in ``budget``."""
    sizes = np.cumsum([d.size for d in docs])
    return docs[:int(np.searchsorted(sizes, budget, side="right"))]


def write_split(out: Path, name: str, docs: list[np.ndarray]) -> int:
    """``name``.bin (tokens back to back) and ``name``.starts.npy; returns the token count."""
    tokens = np.concatenate(docs) if docs else np.zeros(0, np.uint16)
    tokens.tofile(out / f"{name}.bin")
    np.save(out / f"{name}.starts.npy", np.cumsum([0] + [d.size for d in docs[:-1]]))
    return int(tokens.size)


def build(out: Path, stdlib: Path, traces: Path, *, vocab_size: int, max_tokens: int,
          val_fraction: float, seed: int) -> dict:
    """Build tokenizer and corpus into ``out``; returns the manifest (also written there)."""
    rng = random.Random(seed)
    files = stdlib_files(stdlib)
    code = [p.read_text("utf-8", errors="replace") for p in files]
    chats = {name: last_requests(traces / log) for name, log in LOGS.items() if (traces / log).is_file()}
    for requests in chats.values():
        rng.shuffle(requests)  # the order budgets cut in, and the tokenizer sample's
    sample, chars = list(code), 0
    for text in (t for requests in chats.values() for t in message_texts(requests)):
        if chars >= TOKENIZER_SAMPLE_CHARS:
            break
        sample.append(text)
        chars += len(text)
    vocab = train_tokenizer(sample, out / "tokenizer", vocab_size=vocab_size)
    renderer = ChatRenderer(Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json")), TEMPLATE,
                            bos_token=BOS, eos_token=EOS, name="irminsul-default")
    sources = {"cpython-stdlib": (encode_documents(renderer, code), len(files))}
    sources.update({name: (encode_chats(renderer, reqs), len(reqs)) for name, reqs in chats.items()})
    # Smaller sources go in whole; the largest (mini-swe-agent) fills what the budget leaves.
    left = max_tokens
    for name in sorted(sources, key=lambda n: sum(d.size for d in sources[n][0])):
        docs, count = sources[name]
        sources[name] = (within_budget(docs, left), count)
        left -= sum(d.size for d in sources[name][0])
    train: list[np.ndarray] = []
    val: list[np.ndarray] = []
    stats = {}
    for name, (docs, count) in sources.items():
        tr, va = split(docs, val_fraction, rng)
        train += tr
        val += va
        stats[name] = {"available_documents": count, "documents": len(docs),
                       "train_tokens": int(sum(d.size for d in tr)),
                       "val_tokens": int(sum(d.size for d in va)), **SOURCE_INFO[name]}
    rng.shuffle(train)
    manifest = {
        "seed": seed, "vocab_size": vocab, "val_fraction": val_fraction, "max_tokens": max_tokens,
        "train_tokens": write_split(out, "train", train), "val_tokens": write_split(out, "val", val),
        "train_documents": len(train), "val_documents": len(val), "sources": stats,
        "stdlib_root": str(stdlib), "traces": str(traces),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1), "utf-8")
    return manifest


SOURCE_INFO = {
    "cpython-stdlib": {
        "what": "CPython 3.11 standard library *.py, incl. pydoc_data/topics.py (reference docs)",
        "license": "PSF License Agreement for Python 3.11 (PSF-2.0)",
        "license_file": "/usr/lib/python3.11/LICENSE.txt"},
    "tau-bench": {
        "what": "sierra-research/tau-bench airline trajectories (GPT-4o agent), each session's "
                "longest request, rendered with the chat template",
        "license": "MIT", "license_file": "/work/shared/traces/LICENSE.tau-bench"},
    "mini-swe-agent": {
        "what": "mini-swe-agent + Gemini 3 Pro on SWE-bench Verified, each session's longest "
                "request, rendered with the chat template",
        "license": "MIT", "license_file": "/work/shared/traces/LICENSE.mini-swe-agent"},
}


def main(argv: list[str] | None = None) -> None:
    """Command line: build into ``--out`` (default .train/ at the repository root)."""
    root = Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=root / ".train")
    parser.add_argument("--stdlib", type=Path, default=Path("/usr/lib/python3.11"))
    parser.add_argument("--traces", type=Path, default=Path("/work/shared/traces"))
    parser.add_argument("--vocab-size", type=int, default=8192)
    # 15M uint16 tokens = 30 MB: the corpus travels to the GPU machine beside the repository.
    parser.add_argument("--max-tokens", type=int, default=15_000_000)
    parser.add_argument("--val-fraction", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = build(args.out, args.stdlib, args.traces, vocab_size=args.vocab_size,
                     max_tokens=args.max_tokens, val_fraction=args.val_fraction, seed=args.seed)
    print(json.dumps({k: v for k, v in manifest.items() if k != "sources"}, indent=1))
    for name, stat in manifest["sources"].items():
        print(f"{name}: {stat['documents']}/{stat['available_documents']} documents, "
              f"{stat['train_tokens']:,} train + {stat['val_tokens']:,} val tokens")


if __name__ == "__main__":
    main()
