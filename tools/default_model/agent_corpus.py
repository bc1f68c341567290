"""Render the in-domain agent data for the retrain into a compact directory to carry to the GPU.

The GPU machine cannot read /work/shared, so this runs here: the tau-bench and mini-swe-agent
request logs (MIT) are rendered with the EXISTING default-model tokenizer and chat template
(``irminsul/default_model``), each session's longest request kept, as ``build_corpus.py`` does.
It also renders the evaluation's chat and code prompts to token ids (``prompts.json``), so the GPU
run can print greedy samples without the chat renderer (it needs jinja2 and irminsul).

Writes ``--out`` (default ``.retrain/agent``, git-ignored): ``train.bin`` / ``val.bin`` (uint16, each
session BOS ... EOS), ``train.starts.npy`` / ``val.starts.npy``, ``manifest.json`` (sources,
licenses, token counts), ``LICENSE.tau-bench``, ``LICENSE.mini-swe-agent``, ``prompts.json``.
Validation is held out by session (seeded), per source.

Usage: ``python tools/default_model/agent_corpus.py [--out .retrain/agent]``
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout, not installed

from build_corpus import LOGS, SOURCE_INFO, encode_chats, last_requests, split  # noqa: E402
from chat_format import BOS, CHAT_PROMPTS, CODE_PROMPTS  # noqa: E402

from irminsul.traffic.render import ChatRenderer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def write_split(out: Path, name: str, docs: list[np.ndarray]) -> int:
    """``name``.bin and ``name``.starts.npy; returns the token count."""
    np.concatenate(docs).astype(np.uint16).tofile(out / f"{name}.bin")
    np.save(out / f"{name}.starts.npy", np.cumsum([0] + [d.size for d in docs[:-1]]).astype(np.int64))
    return int(sum(d.size for d in docs))


def prompts(renderer: ChatRenderer) -> list[dict]:
    """The sample prompts as token ids: chats with the generation prompt, code after BOS."""
    bos = renderer.tokenizer.token_to_id(BOS)
    out = [{"kind": "chat", "prompt": m[-1]["content"],
            "ids": [int(t) for t in renderer.render(m, add_generation_prompt=True).tokens]}
           for m in CHAT_PROMPTS]
    out += [{"kind": "code", "prompt": c, "ids": [bos, *map(int, renderer.encode(c))]}
            for c in CODE_PROMPTS]
    return out


def build(out: Path, model_dir: Path, traces: Path, *, val_fraction: float, seed: int,
          max_sessions: int | None) -> dict:
    """Render, split and write; returns the manifest."""
    rng = random.Random(seed)
    renderer = ChatRenderer.from_dir(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    train: list[np.ndarray] = []
    val: list[np.ndarray] = []
    sources = {}
    for name, log in LOGS.items():
        requests = last_requests(traces / log)
        rng.shuffle(requests)
        requests = requests[:max_sessions] if max_sessions else requests
        tr, va = split(encode_chats(renderer, requests), val_fraction, rng)
        train += tr
        val += va
        license_file = out / f"LICENSE.{name}"
        shutil.copyfile(traces / f"LICENSE.{name}", license_file)
        sources[name] = {**SOURCE_INFO[name], "license_file": license_file.name,
                         "available_documents": len(requests), "documents": len(tr) + len(va),
                         "train_tokens": int(sum(d.size for d in tr)),
                         "val_tokens": int(sum(d.size for d in va))}
    rng.shuffle(train)
    manifest = {"seed": seed, "val_fraction": val_fraction,
                "tokenizer": str(model_dir / "tokenizer.json"),
                "train_tokens": write_split(out, "train", train),
                "val_tokens": write_split(out, "val", val), "train_documents": len(train),
                "val_documents": len(val), "sources": sources}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1), "utf-8")
    (out / "prompts.json").write_text(json.dumps(prompts(renderer), indent=1), "utf-8")
    return manifest


def main(argv: list[str] | None = None) -> None:
    """Command line: build into ``--out`` and print the counts and the directory's size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".retrain" / "agent")
    parser.add_argument("--model", type=Path, default=ROOT / "irminsul" / "default_model")
    parser.add_argument("--traces", type=Path, default=Path("/work/shared/traces"))
    parser.add_argument("--val-fraction", type=float, default=0.02)
    parser.add_argument("--max-sessions", type=int, help="per source (smoke tests)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    manifest = build(args.out, args.model, args.traces, val_fraction=args.val_fraction,
                     seed=args.seed, max_sessions=args.max_sessions)
    for name, s in manifest["sources"].items():
        print(f"{name}: {s['documents']}/{s['available_documents']} sessions, "
              f"{s['train_tokens']:,} train + {s['val_tokens']:,} val tokens")
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"{args.out}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
