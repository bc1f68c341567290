"""Evaluate a trained default model on CPU and write its figures (eval.json) and README.md.

Figures: validation loss against a unigram baseline (the training split's token distribution,
add-one smoothed, scored on the validation split); greedy samples for chat and code prompts; the
attention-sink share per layer (attention probability on key positions [0, 32) from queries at
positions >= 1024 of long validation documents, transformers' eager attention); the largest logit
difference between Irminsul's runtime and transformers (fp32); and the output-consistency study
(``irminsul consistency``) on its default workload, agent_meta built from the shipped samples.

Usage: ``python tools/default_model/evaluate_default_model.py MODEL_DIR [--data DIR] [--agent-data DIR]``
(``--data`` defaults to ``.train/``; the GPU retrain's ``data/`` holds its code validation split).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from chat_format import BOS, CHAT_PROMPTS, CODE_PROMPTS
from model_card import write_readme

from irminsul import cli
from irminsul.analysis.consistency import full_continuation
from irminsul.model import MLAModel, load_model
from irminsul.traffic.render import ChatRenderer

ROOT = Path(__file__).resolve().parents[2]
SINK_WIDTH, SINK_FROM = 32, 1024


def windows(tokens: np.ndarray, starts: np.ndarray, length: int, count: int) -> list[np.ndarray]:
    """Up to ``count`` windows of ``length`` tokens, each from the start of a document at least
    that long (evenly spread over such documents)."""
    ends = np.append(starts[1:], tokens.size)
    long = starts[ends - starts >= length]
    picks = long[np.linspace(0, long.size - 1, min(count, long.size)).astype(int)] if long.size else []
    return [tokens[s:s + length].astype(np.int64) for s in picks]


def train_counts(data: Path, vocab_size: int) -> np.ndarray:
    """Token counts of the training split: ``train.counts.npy`` where the corpus builder left
    them (the GPU retrain returns counts, not its 260 MB train.bin), else counted from train.bin."""
    if (data / "train.counts.npy").is_file():
        counts = np.load(data / "train.counts.npy")
    else:
        counts = np.bincount(np.fromfile(data / "train.bin", dtype=np.uint16))
    out = np.zeros(vocab_size, np.float64)
    out[:min(vocab_size, counts.size)] = counts[:vocab_size]
    return out


def loss_figures(model: MLAModel, data: Path, length: int, count: int) -> dict:
    """Validation loss (nats/token) of the model and of the unigram baseline."""
    val = np.fromfile(data / "val.bin", dtype=np.uint16)
    counts = train_counts(data, model.config.vocab_size) + 1.0
    unigram = float(-np.log(counts / counts.sum())[val].mean())
    offsets = np.linspace(0, val.size - length - 1, count).astype(np.int64)
    losses = []
    for o in offsets:
        ids = torch.from_numpy(val[o:o + length + 1].astype(np.int64))
        with torch.no_grad():
            logits = model.logits(ids[:-1])
        losses.append(float(torch.nn.functional.cross_entropy(logits.float(), ids[1:])))
    loss = float(np.mean(losses))
    return {"val_loss": loss, "val_perplexity": float(np.exp(loss)), "unigram_loss": unigram,
            "unigram_perplexity": float(np.exp(unigram)), "windows": count, "window_tokens": length}


def samples(model: MLAModel, renderer: ChatRenderer, stops: set[int], tokens: int) -> list[dict]:
    """Greedy continuations of the chat and code prompts, cut at the first stop token."""
    out = []
    prompts = [("chat", renderer.render(m).tokens, m[-1]["content"]) for m in CHAT_PROMPTS]
    bos = renderer.tokenizer.token_to_id(BOS)
    prompts += [("code", np.concatenate([[bos], renderer.encode(c)]).astype(np.int32), c)
                for c in CODE_PROMPTS]
    for kind, ids, text in prompts:
        with torch.no_grad():
            continuation, _ = full_continuation(model, ids, tokens)
        cut = next((i for i, t in enumerate(continuation) if t in stops), len(continuation))
        out.append({"kind": kind, "prompt": text,
                    "output": renderer.tokenizer.decode(continuation[:cut],
                                                        skip_special_tokens=False)})
    return out


def sink_share(model_dir: Path, prompts: list[np.ndarray], ours: MLAModel) -> dict:
    """Per layer, the mean attention mass on keys [0, SINK_WIDTH) and on key 0 alone from queries
    >= SINK_FROM (over heads, queries and prompts), with transformers' eager attention, and what
    uniform attention would give; also the largest fp32 logit difference between transformers and
    Irminsul's runtime on the same prompts."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    per_layer, first, diff = [], [], 0.0
    for ids in prompts:
        x = torch.from_numpy(ids)[None]
        with torch.no_grad():
            out = reference(input_ids=x, output_attentions=True)
        per_layer.append([float(a[0, :, SINK_FROM:, :SINK_WIDTH].sum(-1).mean())
                          for a in out.attentions])
        # Position 0 alone (BOS: every prompt starts at a document start) tells a sink on the
        # first token apart from attention that merely reaches the first 32 positions.
        first.append([float(a[0, :, SINK_FROM:, 0].mean()) for a in out.attentions])
        diff = max(diff, float((ours.logits(x[0]) - out.logits[0]).abs().max()))
    queries = np.arange(SINK_FROM, prompts[0].size) + 1
    return {"per_layer": [round(float(s), 4) for s in np.mean(per_layer, axis=0)],
            "position0_per_layer": [round(float(s), 4) for s in np.mean(first, axis=0)],
            "uniform_share": float(np.mean(SINK_WIDTH / queries)),
            "uniform_position0": float(np.mean(1 / queries)),
            "prompts": len(prompts), "prompt_tokens": int(prompts[0].size),
            "max_logit_diff_vs_transformers": diff}


def consistency_study(model_dir: Path, requests: int, tokens: int) -> dict:
    """``irminsul consistency`` on its default workload (agent_meta built from the shipped
    samples with the model's tokenizer)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "consistency.json"
        if cli.main(["-q", "consistency", "--model", str(model_dir), "--requests", str(requests),
                     "--tokens", str(tokens), "--json", str(report)]):
            raise RuntimeError("irminsul consistency failed")
        result = json.loads(report.read_text("utf-8"))
    result.pop("per_request")
    return result


def main(argv: list[str] | None = None) -> dict:
    """Evaluate, write MODEL_DIR/eval.json and MODEL_DIR/README.md; returns the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--data", type=Path, default=ROOT / ".train",
                        help="the corpus the loss, unigram baseline and sink prompts come from")
    parser.add_argument("--agent-data", type=Path,
                        help="also the loss on this agent corpus' validation split (.retrain/agent)")
    parser.add_argument("--loss-windows", type=int, default=16)
    parser.add_argument("--loss-tokens", type=int, default=2048)
    parser.add_argument("--sink-prompts", type=int, default=4)
    parser.add_argument("--sink-tokens", type=int, default=2048)
    parser.add_argument("--sample-tokens", type=int, default=48)
    parser.add_argument("--consistency-requests", type=int, default=12)
    parser.add_argument("--consistency-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    started = time.time()
    model = load_model(args.model)
    renderer = ChatRenderer.from_dir(args.model)
    generation = json.loads((args.model / "generation_config.json").read_text("utf-8"))
    val = np.fromfile(args.data / "val.bin", dtype=np.uint16)
    long_prompts = windows(val, np.load(args.data / "val.starts.npy"), args.sink_tokens,
                           args.sink_prompts)
    figures = {
        "loss": loss_figures(model, args.data, args.loss_tokens, args.loss_windows),
        **({"agent_loss": loss_figures(model, args.agent_data, args.loss_tokens, args.loss_windows)}
           if args.agent_data else {}),
        "attention_sink": sink_share(args.model, long_prompts, model),
        "samples": samples(model, renderer, set(generation["eos_token_id"]), args.sample_tokens),
        "consistency": consistency_study(args.model, args.consistency_requests,
                                         args.consistency_tokens),
    }
    import transformers

    figures["environment"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                              "threads": torch.get_num_threads(),
                              "seconds": round(time.time() - started, 1)}
    (args.model / "eval.json").write_text(json.dumps(figures, indent=1), "utf-8")
    write_readme(args.model, figures)
    print(json.dumps({k: v for k, v in figures.items() if k != "samples"}, indent=1))
    return figures


if __name__ == "__main__":
    main()
