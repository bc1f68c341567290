"""The attention kernel on decode batches: B requests × 1 new token over C keys each, one layer.

For each (batch, context) it times the engine's launches — the eager layout's default and the
CUDA graph a decode batch of that size replays — and a sweep of rows per block, key splits and
tile shapes, as device time per call (``common.per_call``), and scores each by the bytes it must
read (every key's c_KV and k_r row, and its two slot ids) over the measured copy bandwidth.

    python benchmarks/gpu/decode_attention.py --out F.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
import roofline
import torch
from common import V2_LITE, per_call, run_metadata
from triton.runtime.errors import OutOfResources

from irminsul.engine.graphs import BUCKETS, block_rows, whole_blocks
from irminsul.kernels import PagedLayout, TileConfig, paged_mla_attention
from irminsul.kernels.mla_attention import key_splits
from irminsul.model import parse_config
from irminsul.model.rope import softmax_scale

HEADS, RANK, ROPE = 16, 512, 64


def cells(batch: int, context: int, copy_gbps: float, repeats: int, sweep: bool) -> dict:
    device = "cuda"
    config = parse_config(V2_LITE)
    scale = softmax_scale(config)
    slots = batch * context
    gen = torch.Generator(device=device).manual_seed(0)
    ckv = torch.randn(slots, RANK, device=device, generator=gen).bfloat16()
    kr = torch.randn(slots, ROPE, device=device, generator=gen).bfloat16()
    q = (torch.randn(batch, HEADS, RANK + ROPE, device=device, generator=gen) * 0.1).bfloat16()
    # Each request's keys: its own contiguous run of slots, as a prefilled request holds them.
    keys = [i * context + np.arange(context) for i in range(batch)]
    new = [1] * batch
    nbytes = batch * context * ((RANK + ROPE) * 2 + 8)
    floor_ms = nbytes / (copy_gbps * 1e9) * 1e3
    row: dict = {"batch": batch, "context": context, "floor_ms": floor_ms}

    def run(label: str, layout: PagedLayout, tiles: TileConfig | None = None) -> None:
        fn = lambda: paged_mla_attention(q, ckv, kr, layout, scale, tiles)  # noqa: E731
        try:
            fn()
        except OutOfResources as err:
            row[label] = str(err)[:80]
            return
        ms = float(np.median([per_call(device, fn).device for _ in range(repeats)])) * 1e3
        row[label] = {"ms": ms, "of_floor": ms / floor_ms,
                      "share_of_copy_bw": floor_ms / ms}

    run("eager default", PagedLayout.build(new, keys, keys, HEADS, device))
    bucket = next(b for b in BUCKETS if b >= batch)
    rows = block_rows(bucket, decode=True)
    graph_splits = key_splits(whole_blocks(bucket, HEADS, rows), rows, device)
    run(f"graph launch m{rows} s{graph_splits}",
        PagedLayout.build(new, keys, keys, HEADS, device, block_m=rows, splits=graph_splits))
    for splits, (block_n, warps, stages) in itertools.product(
            (1, 2, 4, 8, 16, 32, 64) if sweep else (),
            ((64, 4, 2), (64, 4, 3), (32, 4, 3), (64, 8, 2), (128, 8, 2), (32, 2, 3))):
        if splits * 64 > context:
            continue
        layout = PagedLayout.build(new, keys, keys, HEADS, device, block_m=16, splits=splits)
        run(f"m16 s{splits} n{block_n} w{warps} st{stages}", layout,
            TileConfig(block_n, RANK, warps, stages))
    best = min((v["ms"], k) for k, v in row.items() if isinstance(v, dict))
    row["best"] = best[1]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-sweep", action="store_true", help="the engine's launches only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    copy_gbps = roofline.copy_bandwidth("cuda")
    out = {"meta": run_metadata("cuda"), "copy_gbps": copy_gbps, "cells": []}
    for context in args.contexts:
        for batch in args.batches:
            row = cells(batch, context, copy_gbps, args.repeats, not args.no_sweep)
            out["cells"].append(row)
            timed = {k: v for k, v in row.items() if isinstance(v, dict)}
            graph = next(k for k in timed if k.startswith("graph"))
            print(f"B{batch:>4} C{context:>6} floor {row['floor_ms']:.3f} ms | eager "
                  f"{timed['eager default']['ms']:.3f} | {graph} {timed[graph]['ms']:.3f} | best "
                  f"{row['best']} {timed[row['best']]['ms']:.3f} "
                  f"({timed[row['best']]['share_of_copy_bw']:.0%} of copy bw)", flush=True)
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=1)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
