"""Retrain the default model on one GPU in one call: corpus, training, sink measurement, model dir.

Steps, all on the machine that trains (see gpu_retrain.sh for the command and the carry list):

1. ``package_corpus.build``: the permissively licensed installed packages and the standard
   library, tokenized with the existing tokenizer (~100M+ tokens on the H200 machine).
2. ``train_default_model.main``: the ``sink`` architecture (~26.6M parameters), every window opening
   with BOS, ``--agent-share`` of the windows from the carried agent renders (``.retrain/agent``),
   training ended by a deadline so the whole call fits ``--total-minutes``; the model directory is
   checkpointed into OUT/model every ``--checkpoint-minutes``.
3. The figures: per layer, the attention share on position 0 and on [0, 32) from queries >= 1024
   of 2048-token validation documents (code and agent; transformers' eager attention, as
   ``evaluate_default_model.py`` measures it), the validation loss on document-start windows
   and greedy samples, for the new model and, on the same windows, the current default model.

OUT holds afterwards: ``model/`` (the checkpoint with licenses/LICENSE.* for every corpus source,
train_config.json, train_log.txt), ``data/`` (the package corpus' validation split, unigram counts and
manifest, for ``evaluate_default_model.py --data`` on CPU), ``retrain_eval.json``, ``retrain_log.txt``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
SINK_WIDTH = 32


def log_to(path: Path):
    """A print that also appends to ``path`` (the log comes back even if the call is cut off)."""
    def log(line: str) -> None:
        print(line, flush=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
    return log


def doc_windows(tokens: np.ndarray, starts: np.ndarray, length: int, count: int) -> list[np.ndarray]:
    """Up to ``count`` windows of ``length`` tokens, each a whole document's beginning (documents
    at least ``length`` long, evenly spread), as evaluate_default_model.windows picks them."""
    ends = np.append(starts[1:], tokens.size)
    long = starts[ends - starts >= length]
    if not long.size:
        return []
    picks = long[np.linspace(0, long.size - 1, min(count, long.size)).astype(int)]
    return [tokens[s:s + length].astype(np.int64) for s in picks]


def start_windows(tokens: np.ndarray, starts: np.ndarray, length: int, count: int) -> np.ndarray:
    """[n, length + 1] windows opening at evenly spread document starts (documents packed after)."""
    usable = starts[starts + length + 1 <= tokens.size]
    if not usable.size:
        return np.zeros((0, length + 1), np.int64)
    picks = usable[np.linspace(0, usable.size - 1, min(count, usable.size)).astype(int)]
    return np.stack([tokens[s:s + length + 1].astype(np.int64) for s in picks])


@torch.no_grad()
def sink_share(model, prompts: list[np.ndarray], sink_from: int, device: torch.device) -> dict:
    """Per layer, the mean attention on key 0 and on keys [0, SINK_WIDTH) from queries >= sink_from
    (over heads, queries and prompts), and what uniform attention gives."""
    first, width = [], []
    for ids in prompts:
        out = model(input_ids=torch.from_numpy(ids)[None].to(device), output_attentions=True)
        first.append([float(a[0, :, sink_from:, 0].float().mean()) for a in out.attentions])
        width.append([float(a[0, :, sink_from:, :SINK_WIDTH].float().sum(-1).mean())
                      for a in out.attentions])
    queries = np.arange(sink_from, prompts[0].size) + 1
    uniform0 = float(np.mean(1 / queries))
    position0 = np.mean(first, axis=0)
    return {"position0_per_layer": [round(float(v), 4) for v in position0],
            "per_layer": [round(float(v), 4) for v in np.mean(width, axis=0)],
            "position0_over_uniform": [round(float(v / uniform0), 1) for v in position0],
            "uniform_position0": uniform0, "uniform_share": float(np.mean(SINK_WIDTH / queries)),
            "layers_with_sink": int(sum(v >= 10 * uniform0 for v in position0)),
            "prompts": len(prompts), "prompt_tokens": int(prompts[0].size), "queries_from": sink_from}


@torch.no_grad()
def window_loss(model, windows: np.ndarray, device: torch.device, batch: int = 8) -> float:
    """Mean next-token loss (nats/token, fp32) over the windows."""
    total, n = 0.0, 0
    for i in range(0, len(windows), batch):
        x = torch.from_numpy(windows[i:i + batch]).to(device)
        logits = model(input_ids=x[:, :-1]).logits.float()
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(),
                                                         reduction="sum"))
        n += x[:, 1:].numel()
    return total / max(n, 1)


@torch.no_grad()
def greedy(model, prompts: list[dict], stops: set[int], tokens: int, decode, device) -> list[dict]:
    """Greedy continuations (no cache: the prompts are short), cut at the first stop token."""
    out = []
    for p in prompts:
        ids = list(p["ids"])
        new: list[int] = []
        for _ in range(tokens):
            logits = model(input_ids=torch.tensor([ids + new], device=device)).logits[0, -1]
            new.append(int(logits.argmax()))
            if new[-1] in stops:
                new.pop()
                break
        out.append({"kind": p["kind"], "prompt": p["prompt"], "output": decode(new)})
    return out


def measure(model_dir: Path, sets: dict, prompts: list[dict], device: torch.device,
            sink_from: int, sample_tokens: int) -> dict:
    """Sink shares, validation losses and samples of one checkpoint, loaded as shipped."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    started = time.time()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").to(device).eval()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stops = set(json.loads((model_dir / "generation_config.json").read_text("utf-8"))["eos_token_id"])
    figures = {"sink": {name: sink_share(model, s["sink_prompts"], sink_from, device)
                        for name, s in sets.items() if s["sink_prompts"]},
               "val_loss": {name: window_loss(model, s["loss_windows"], device)
                            for name, s in sets.items() if len(s["loss_windows"])},
               "samples": greedy(model, prompts, stops, sample_tokens,
                                 lambda ids: tokenizer.decode(ids, skip_special_tokens=False), device)}
    prompts_all = [p for s in sets.values() for p in s["sink_prompts"]]
    if prompts_all:
        figures["sink"]["all"] = sink_share(model, prompts_all, sink_from, device)
    figures["seconds"] = round(time.time() - started, 1)
    del model
    return figures


def merge_corpus(model_dir: Path, corpus: dict, agent: dict, agent_share: float) -> None:
    """train_config.json's corpus: every source (packages, stdlib, agent) with its
    licenses/LICENSE.<name> beside the weights, in the form model_card.py reads."""
    record = json.loads((model_dir / "train_config.json").read_text("utf-8"))
    sources = {}
    for name, s in {**corpus["sources"], **agent["sources"]}.items():
        sources[name] = {**s, "license_file": str(model_dir / "licenses" / f"LICENSE.{name}")}
    record["corpus"] = {"vocab_size": 8192,
                        "train_tokens": corpus["train_tokens"] + agent["train_tokens"],
                        "val_tokens": corpus["val_tokens"] + agent["val_tokens"],
                        "package_train_tokens": corpus["train_tokens"],
                        "agent_train_tokens": agent["train_tokens"], "agent_share": agent_share,
                        "refused": corpus["refused"], "sources": sources}
    (model_dir / "train_config.json").write_text(json.dumps(record, indent=1), "utf-8")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=6.0, help="training budget (at most)")
    parser.add_argument("--total-minutes", type=float, default=8.5,
                        help="whole-run budget: training is cut so corpus + training + figures fit")
    parser.add_argument("--reserve-seconds", type=float, default=75.0,
                        help="kept after training for the final eval, saving and the figures")
    parser.add_argument("--work", type=Path, default=Path("/tmp/irminsul-retrain"))
    parser.add_argument("--agent-data", type=Path, default=ROOT / ".retrain" / "agent")
    parser.add_argument("--agent-share", type=float, default=0.2)
    parser.add_argument("--arch", default="sink")
    parser.add_argument("--single-bos", action="store_true",
                        help="a window's only BOS at position 0 (train_default_model.py)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.2)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--steps", type=int, help="fixed step count (smoke tests, exact re-runs)")
    parser.add_argument("--checkpoint-minutes", type=float, default=1.5)
    parser.add_argument("--state", type=Path,
                        help="resumable training across device calls: the state file (keep it, "
                        "and --work, on the GPU machine between back-to-back calls, e.g. under "
                        "the git-ignored .retrain_state/); --minutes is then the whole schedule")
    parser.add_argument("--packages", help="comma-separated distributions only (smoke tests)")
    parser.add_argument("--no-stdlib", action="store_true")
    parser.add_argument("--max-tokens", type=int, help="cap on package training tokens (smoke)")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--val-fraction", type=float, default=0.01, help="package corpus, by file")
    parser.add_argument("--sink-tokens", type=int, default=2048)
    parser.add_argument("--sink-prompts", type=int, default=4, help="per validation set")
    parser.add_argument("--loss-windows", type=int, default=64, help="per validation set")
    parser.add_argument("--sample-tokens", type=int, default=48)
    parser.add_argument("--old-model", type=Path, default=ROOT / "irminsul" / "default_model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the whole retrain; returns the figures written to OUT/retrain_eval.json."""
    import os

    import package_corpus
    import train_default_model

    args = parse_args(argv)
    started = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    log = log_to(args.out / "retrain_log.txt")
    log(f"retrain: {json.dumps({k: str(v) for k, v in vars(args).items()})}")
    corpus_dir, model_dir = args.work / "corpus", args.out / "model"
    only = ({package_corpus.re.sub(r"[-_.]+", "-", p.lower()) for p in args.packages.split(",")}
            if args.packages else None)
    if args.state and (corpus_dir / "manifest.json").is_file() and args.state.is_file():
        # A resumed schedule trains on the corpus its first call built (same machine, kept in
        # --work): rebuilding could change the data order the saved state points into.
        corpus = json.loads((corpus_dir / "manifest.json").read_text("utf-8"))
        log(f"corpus: reusing {corpus_dir} ({corpus['train_tokens']:,} train tokens)")
    else:
        corpus = package_corpus.build(corpus_dir, only=only, stdlib=not args.no_stdlib,
                                      workers=args.workers or os.cpu_count() or 1,
                                      max_tokens=args.max_tokens, seed=0, log=log,
                                      val_fraction=args.val_fraction)
    log(package_corpus.summary(corpus))
    deadline = started + 60 * args.total_minutes - args.reserve_seconds
    train_args = ["--data", str(corpus_dir), "--tokenizer", str(ROOT / "irminsul" / "default_model"),
                  "--out", str(model_dir), "--arch", args.arch, "--bos-windows",
                  "--agent-data", str(args.agent_data), "--agent-share", str(args.agent_share),
                  "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--lr", str(args.lr),
                  "--weight-decay", str(args.weight_decay), "--warmup", str(args.warmup),
                  "--minutes", str(args.minutes), "--deadline", str(deadline),
                  "--checkpoint-minutes", str(args.checkpoint_minutes),
                  "--eval-windows", str(args.loss_windows), "--device", args.device]
    if args.single_bos:
        train_args.append("--single-bos")
    if args.steps:
        train_args += ["--steps", str(args.steps)]
    if args.state:
        train_args += ["--state", str(args.state)]
    log(f"train: {' '.join(train_args)} (corpus took {time.time() - started:.0f}s)")
    record = train_default_model.main(train_args)
    agent = json.loads((args.agent_data / "manifest.json").read_text("utf-8"))
    licenses = model_dir / "licenses"
    licenses.mkdir(exist_ok=True)
    for license_file in (corpus_dir / "licenses").iterdir():
        shutil.copyfile(license_file, licenses / license_file.name)
    for name in agent["sources"]:
        shutil.copyfile(args.agent_data / f"LICENSE.{name}", licenses / f"LICENSE.{name}")
    merge_corpus(model_dir, corpus, agent, args.agent_share)
    data_out = args.out / "data"
    data_out.mkdir(exist_ok=True)
    for name in ("val.bin", "val.starts.npy", "train.counts.npy", "manifest.json"):
        shutil.copyfile(corpus_dir / name, data_out / name)
    log(f"model written to {model_dir} at {time.time() - started:.0f}s")

    sets = {}
    for name, directory in (("code", corpus_dir), ("agent", args.agent_data)):
        tokens = np.fromfile(directory / "val.bin", dtype=np.uint16)
        starts = np.load(directory / "val.starts.npy")
        sets[name] = {"sink_prompts": doc_windows(tokens, starts, args.sink_tokens, args.sink_prompts),
                      "loss_windows": start_windows(tokens, starts, min(2048, args.seq_len),
                                                    args.loss_windows)}
    prompts = json.loads((args.agent_data / "prompts.json").read_text("utf-8"))
    device = torch.device(args.device)
    sink_from = args.sink_tokens // 2  # 1024 for the 2048-token prompts, as evaluate_default_model
    kept = ("steps", "tokens_seen", "train_seconds", "final_train_loss", "val_losses", "passes",
            "parameters")
    figures = {"train": {k: record[k] for k in kept},
               "new": measure(model_dir, sets, prompts, device, sink_from, args.sample_tokens)}
    sink = figures["new"]["sink"].get("all")
    if sink:
        log(f"sink (new): position 0 / uniform per layer {sink['position0_over_uniform']}; "
            f"{sink['layers_with_sink']} of {len(sink['position0_per_layer'])} layers >= 10x")
    log(f"val loss (new, 2048-token doc-start windows): {figures['new']['val_loss']}")
    (args.out / "retrain_eval.json").write_text(json.dumps(figures, indent=1), "utf-8")
    try:  # the current model on the same windows: the comparison, not a condition of success
        figures["old"] = measure(args.old_model, sets, prompts, device, sink_from, args.sample_tokens)
        log(f"val loss (old): {figures['old']['val_loss']}")
    except Exception as err:  # noqa: BLE001 - a failed comparison must not lose the new model's figures
        figures["old"] = {"error": repr(err)}
        log(f"old model not measured: {err!r}")
    figures["wall_seconds"] = round(time.time() - started, 1)
    (args.out / "retrain_eval.json").write_text(json.dumps(figures, indent=1), "utf-8")
    for s in figures["new"]["samples"]:
        log(f"[{s['kind']}] {s['prompt'][:50]!r} -> {s['output'][:160]!r}")
    log(f"retrain: done in {figures['wall_seconds']:.0f}s")
    return figures


if __name__ == "__main__":
    main()
