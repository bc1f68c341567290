"""Where each attention head of a trained model looks, from late queries of long documents.

The sink figure (retrain.py, evaluate_default_model.py) averages a layer's heads; this splits it
per head and says what a head without a sink does instead: its share on position 0, on the 8
keys up to and including its own position (a local head), and its largest single weight (how
peaked it is). Queries are positions >= ``--from`` of windows of ``--tokens`` opening at
document starts (transformers' eager attention, fp32, CPU is enough for the default model).

Usage: ``python tools/default_model/attention_heads.py MODEL_DIR DATA_DIR [DATA_DIR ...]
[--out F.json]`` where each DATA_DIR holds ``val.bin`` / ``val.starts.npy`` (the retrain's
``data/``, or ``.retrain/agent``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

LOCAL = 8  # keys at distance 0..LOCAL-1 from the query


def doc_windows(data: Path, length: int, count: int) -> list[np.ndarray]:
    """``count`` windows of ``length`` tokens at the starts of documents that long, evenly spread."""
    tokens = np.fromfile(data / "val.bin", dtype=np.uint16)
    starts = np.load(data / "val.starts.npy")
    ends = np.append(starts[1:], tokens.size)
    long = starts[ends - starts >= length]
    picks = long[np.linspace(0, long.size - 1, min(count, long.size)).astype(int)]
    return [tokens[s:s + length].astype(np.int64) for s in picks]


@torch.no_grad()
def head_shares(model, prompts: list[np.ndarray], first: int) -> dict:
    """Per layer and head, means over prompts and queries >= ``first``: attention on position 0,
    on the LOCAL nearest keys, and the largest single weight."""
    sums = None
    for ids in prompts:
        out = model(input_ids=torch.from_numpy(ids)[None], output_attentions=True)
        q = torch.arange(first, ids.size)[:, None]
        distance = q - torch.arange(ids.size)[None, :]
        local = ((distance >= 0) & (distance < LOCAL)).float()
        rows = []
        for a in out.attentions:
            a = a[0, :, first:, :].float()  # [heads, queries, keys]
            rows.append(torch.stack([a[..., 0].mean(-1), (a * local).sum(-1).mean(-1),
                                     a.max(-1).values.mean(-1)]))
        layer = torch.stack(rows).numpy()  # [layers, 3, heads]
        sums = layer if sums is None else sums + layer
    mean = sums / len(prompts)
    uniform0 = float(np.mean(1 / (np.arange(first, prompts[0].size) + 1)))
    return {"position0": mean[:, 0].round(4).tolist(), "local": mean[:, 1].round(3).tolist(),
            "top1": mean[:, 2].round(3).tolist(), "uniform_position0": uniform0,
            "sink_heads_per_layer": (mean[:, 0] >= 10 * uniform0).sum(-1).tolist(),
            "local_heads_per_layer": (mean[:, 1] >= 0.5).sum(-1).tolist(),
            "prompts": len(prompts), "tokens": int(prompts[0].size), "queries_from": first}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("data", type=Path, nargs="+")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--from", dest="first", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=3, help="per data directory")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    prompts = [w for d in args.data for w in doc_windows(d, args.tokens, args.prompts)]
    figures = {"model": str(args.model), "data": [str(d) for d in args.data],
               **head_shares(model, prompts, args.first)}
    for layer, (p0, local) in enumerate(zip(figures["position0"], figures["local"])):
        print(f"layer {layer}: position 0 {' '.join(f'{v:.3f}' for v in p0)} | "
              f"local {' '.join(f'{v:.2f}' for v in local)}")
    print(f"heads >= 10x uniform on position 0, per layer: {figures['sink_heads_per_layer']}; "
          f"local heads (>= half within {LOCAL}): {figures['local_heads_per_layer']}")
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1) + "\n", "utf-8")
    return figures


if __name__ == "__main__":
    main()
