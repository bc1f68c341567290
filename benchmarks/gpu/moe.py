"""The routed experts of one MoE layer: torch's grouped GEMMs against the fused Triton kernel.

DeepSeek-V2-Lite's expert shapes (hidden 2048, 64 routed experts, top-6, intermediate 1408) with
random bf16 weights and real routing (softmax top-6 of random logits). Per token count T, device
time per call (``common.per_call``, median of repeats) of

    grouped    MoE's torch path: sort, gathered rows, two torch._grouped_mm, index_add
    fused      irminsul.kernels.fused_moe at its default tiles (block sort included), and the
               block sort alone
    sweep      (``--sweep``) the fused kernel at a few other tile shapes (``--sweep decode``:
               16-row blocks only, the decode shapes)

each scored against the floor: the distinct touched experts' weight bytes (w13 and w2 rows)
over the measured copy bandwidth, so "of copy bw" = floor / time. The per-step figure is the
time × the 26 MoE layers of V2-Lite. Prints a table and writes JSON (``--out``).

    python benchmarks/gpu/moe.py --sweep --out moe.json
    python benchmarks/gpu/moe.py --device cpu --tiny --tokens 1 5 --out F.json   # CI smoke
"""

from __future__ import annotations

import os
import sys

# On a CPU the kernels run under Triton's interpreter, which must be on before triton is first
# imported (the imports below bring it in).
if "--device=cpu" in sys.argv or any(a == "--device" and b == "cpu"
                                     for a, b in zip(sys.argv, sys.argv[1:])):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
from dataclasses import astuple  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import roofline  # noqa: E402
import torch  # noqa: E402
from common import TINY, V2_LITE, per_call, run_metadata  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from irminsul.kernels import fused_moe  # noqa: E402
from irminsul.model.moe import grouped_experts  # noqa: E402

MOE_LAYERS = 26  # V2-Lite: 27 layers, the first dense
SWEEP = [(16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 8, 3),
         (32, 64, 128, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 8, 3), (128, 128, 64, 8, 3)]
# Decode shapes (16-row blocks): narrower and wider columns, K steps, warps, stages.
SWEEP_DECODE = [(16, 16, 128, 4, 4), (16, 16, 256, 4, 4), (16, 16, 256, 2, 4), (16, 16, 512, 4, 3),
                (16, 32, 128, 4, 6), (16, 32, 256, 4, 3), (16, 32, 256, 4, 4), (16, 32, 64, 4, 6),
                (16, 32, 128, 2, 4), (16, 32, 256, 8, 4), (16, 64, 128, 4, 4), (16, 64, 256, 4, 4),
                (16, 32, 128, 8, 4)]


def problem(raw: dict[str, Any], tokens: int, device: str, dtype: torch.dtype,
            seed: int) -> dict[str, torch.Tensor]:
    """Inputs and routing of one call: x [T, D], real softmax top-k of random logits."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dim, experts, k = raw["hidden_size"], raw["n_routed_experts"], raw["num_experts_per_tok"]
    x = torch.randn(tokens, dim, device=device, generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, device=device, generator=gen)
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    return {"x": x, "weights": weights, "ids": ids}


def cell(raw: dict[str, Any], tokens: int, w13: torch.Tensor, w2: torch.Tensor, device: str,
         copy_gbps: float, repeats: int, calls: int, sweep: str | None) -> dict[str, Any]:
    p = problem(raw, tokens, device, w13.dtype, seed=tokens)
    x, weights, ids = p["x"], p["weights"], p["ids"]
    touched = int(torch.unique(ids).numel())
    nbytes = touched * (w13[0].nbytes + w2[0].nbytes)
    floor_ms = nbytes / (copy_gbps * 1e9) * 1e3
    tiles = fused_moe.MoETiles.for_tokens(tokens, ids.shape[1], w13.shape[0], w13.dtype)
    row: dict[str, Any] = {"tokens": tokens, "experts_touched": touched, "weight_bytes": nbytes,
                           "floor_ms": floor_ms, "default_tiles": list(astuple(tiles))}

    def timing(label: str, fn: Any) -> None:
        try:
            fn()  # compiled, memory allocated
        except OutOfResources as err:
            row[label] = str(err)[:80]
            return
        ms = float(np.median([per_call(device, fn, calls).device for _ in range(repeats)])) * 1e3
        row[label] = {"ms": ms, "of_copy_bw": floor_ms / ms, "step_ms": ms * MOE_LAYERS}

    grouped = grouped_experts(x, w13, w2, weights, ids).float()
    fused = fused_moe.fused_experts(x, w13, w2, weights, ids).float()
    row["max_rel_diff"] = float((fused - grouped).abs().max() / grouped.abs().max())
    timing("grouped", lambda: grouped_experts(x, w13, w2, weights, ids))
    timing("fused", lambda: fused_moe.fused_experts(x, w13, w2, weights, ids))
    timing("align", lambda: fused_moe.align_blocks(ids, w13.shape[0], tiles.block_m))
    shapes = (SWEEP_DECODE if sweep == "decode" else SWEEP) if sweep else ()
    for shape in shapes:
        t = fused_moe.MoETiles(*shape)
        timing("fused m{} n{} k{} w{} s{}".format(*shape),
               lambda t=t: fused_moe.fused_experts(x, w13, w2, weights, ids, t))
    fused_runs = {k: v for k, v in row.items() if k.startswith("fused") and isinstance(v, dict)}
    row["best_fused"] = min(fused_runs, key=lambda k: fused_runs[k]["ms"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny stand-in's experts in float32 (CPU smoke)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per timing")
    parser.add_argument("--sweep", nargs="?", const="all", choices=["all", "decode"],
                        help="also a few other tile shapes (decode: 16-row blocks only)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    raw = TINY if args.tiny else V2_LITE
    dtype = torch.float32 if args.tiny else torch.bfloat16
    dim, experts, inter = raw["hidden_size"], raw["n_routed_experts"], raw["moe_intermediate_size"]
    gen = torch.Generator(device=args.device).manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, dim, device=args.device, generator=gen) * 0.02).to(dtype)
    w2 = (torch.randn(experts, dim, inter, device=args.device, generator=gen) * 0.02).to(dtype)
    copy_gbps = roofline.copy_bandwidth(args.device, nbytes=2**24 if args.tiny else 2**30)
    out: dict[str, Any] = {"meta": run_metadata(args.device), "copy_gbps": copy_gbps,
                           "shape": {"hidden": dim, "experts": experts, "inter": inter,
                                     "topk": raw["num_experts_per_tok"], "dtype": str(dtype)},
                           "cells": []}
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; ms per layer (× {MOE_LAYERS} layers per step)")
    print(f"{'T':>5} {'experts':>7} {'floor':>7} | {'grouped':>7} {'bw':>4} | {'fused':>7} "
          f"{'bw':>4} {'align':>6} | best fused")
    for tokens in args.tokens:
        row = cell(raw, tokens, w13, w2, args.device, copy_gbps, args.repeats, args.calls,
                   args.sweep)
        out["cells"].append(row)
        g, f, a, best = row["grouped"], row["fused"], row["align"], row[row["best_fused"]]
        print(f"{tokens:>5} {row['experts_touched']:>7} {row['floor_ms']:7.3f} | {g['ms']:7.3f} "
              f"{g['of_copy_bw']:4.0%} | {f['ms']:7.3f} {f['of_copy_bw']:4.0%} {a['ms']:6.3f} | "
              f"{row['best_fused']} {best['ms']:.3f} ({best['of_copy_bw']:.0%})  "
              f"diff {row['max_rel_diff']:.1e}", flush=True)
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
