"""The attention kernel on decode batches: B requests × 1 new token over C keys each, one layer.

For each (batch, context) it times the engine's launch — 16-row blocks, each block's keys cut
by their length into pieces, one program per piece, as many pieces as fill one wave of the SMs;
the same launch eager and in a CUDA graph — against the launch it replaced (each request's keys
split evenly over a fixed number of programs, with its tiles), and a sweep of the programs per
SM the pieces fill, tile shapes and the least piece, as device time per call
(``common.per_call``), each scored by the bytes it must read (every key's c_KV and k_r row, and
its two slot ids) over the measured copy bandwidth. Ragged cells (``--ragged``) draw each
request's length log-uniformly between 256 keys and C, where a fixed split per request leaves
programs idle.

    python benchmarks/gpu/decode_attention.py --out F.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import numpy as np
import roofline
import torch
from common import V2_LITE, decode_lengths, per_call, run_metadata
from triton.runtime.errors import OutOfResources

from irminsul.device import sm_count
from irminsul.kernels import PagedLayout, TileConfig, paged_mla_attention
from irminsul.kernels.mla_attention import key_splits
from irminsul.model import parse_config
from irminsul.model.rope import softmax_scale

HEADS, RANK, ROPE = 16, 512, 64
TILES = ((64, 8, 2), (128, 8, 2), (64, 4, 2))
BEFORE = TileConfig(128, RANK, 8, 2)  # the split launch's tiles before the pieces


def cells(batch: int, context: int, ragged: bool, copy_gbps: float, repeats: int,
          sweep: bool) -> dict:
    device = "cuda"
    config = parse_config(V2_LITE)
    scale = softmax_scale(config)
    lengths = decode_lengths(batch, context, ragged)
    slots = int(lengths.sum())
    gen = torch.Generator(device=device).manual_seed(0)
    ckv = torch.randn(slots, RANK, device=device, generator=gen).bfloat16()
    kr = torch.randn(slots, ROPE, device=device, generator=gen).bfloat16()
    q = (torch.randn(batch, HEADS, RANK + ROPE, device=device, generator=gen) * 0.1).bfloat16()
    # Each request's keys: its own contiguous run of slots, as a prefilled request holds them.
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    keys = [s + np.arange(n) for s, n in zip(starts, lengths)]
    new = [1] * batch
    nbytes = slots * ((RANK + ROPE) * 2 + 8)
    floor_ms = nbytes / (copy_gbps * 1e9) * 1e3
    row: dict = {"batch": batch, "context": context, "ragged": ragged,
                 "keys": slots, "floor_ms": floor_ms}

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

    engine = PagedLayout.build(new, keys, keys, HEADS, device)
    run("scheduled (engine)", engine)
    # The same launch over int64 tables, as a CUDA graph's staging buffer holds them: the
    # kernels read every table value as int32, so this should cost nothing (before they did,
    # it cost 1.3-2.9x).
    wide = {f: getattr(engine, f).to(torch.int64) for f in
            ("kv_ckv", "kv_kr", "requests", "block_req", "block_row0", "schedule")
            if getattr(engine, f) is not None}
    run("engine, int64 tables", dataclasses.replace(engine, **wide))
    splits = key_splits(batch, 16, device, int(lengths.max()))
    run(f"split s{splits} (before)", PagedLayout.build(new, keys, keys, HEADS, device,
                                                       block_m=16, splits=splits), BEFORE)
    sms = sm_count(device)
    for waves, (block_n, warps, stages) in itertools.product((1, 2) if sweep else (), TILES):
        layout = PagedLayout.build(new, keys, keys, HEADS, device, programs=waves * sms)
        run(f"P{waves}x n{block_n} w{warps} st{stages}", layout,
            TileConfig(block_n, RANK, warps, stages))
    for least in (128, 256) if sweep else ():  # fewer, longer pieces on short batches
        run(f"P1x least {least}", PagedLayout.build(new, keys, keys, HEADS, device, least=least))
    best = min((v["ms"], k) for k, v in row.items() if isinstance(v, dict))
    row["best"] = best[1]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-sweep", action="store_true", help="the engine's launches only")
    parser.add_argument("--ragged", action="store_true",
                        help="also each batch with lengths drawn between 256 and C")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    copy_gbps = roofline.copy_bandwidth("cuda")
    out = {"meta": run_metadata("cuda"), "copy_gbps": copy_gbps, "cells": []}
    for context, ragged, batch in itertools.product(
            args.contexts, (False, True) if args.ragged else (False,), args.batches):
        if ragged and batch == 1:
            continue
        row = cells(batch, context, ragged, copy_gbps, args.repeats, not args.no_sweep)
        out["cells"].append(row)
        timed = {k: v for k, v in row.items() if isinstance(v, dict)}
        engine = timed["scheduled (engine)"]
        before = next(v for k, v in timed.items() if k.startswith("split"))
        print(f"B{batch:>4} C{context:>6}{' ragged' if ragged else ''} floor "
              f"{row['floor_ms']:.3f} ms | scheduled {engine['ms']:.3f} "
              f"({engine['share_of_copy_bw']:.0%}) | split {before['ms']:.3f} "
              f"({before['share_of_copy_bw']:.0%}) | best {row['best']} "
              f"{timed[row['best']]['ms']:.3f} ({timed[row['best']]['share_of_copy_bw']:.0%})",
              flush=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
