"""A decode step's projections at 1–16 tokens: cuBLAS (torch) against the Triton GEMV.

Per projection of DeepSeek-V2-Lite's (and, with ``--v3``, DeepSeek-V3's) attention — the joint
first projection, W_UK and W_UV as the batched matmuls over heads the decode path runs, o_proj —
and per token count T, device time per call (``common.per_call``, median of repeats) of

    torch   F.linear / torch.bmm on the layouts the model runs them on
    gemv    irminsul.kernels.gemv at its default tiles, and (``--sweep``) at a few others

each against the floor: the weight's bytes over the measured copy bandwidth. Every call reads
another of several copies of the weights, together larger than the L2 cache, as the layers of a
step do. Prints a table and writes JSON (``--out``).

    python benchmarks/gpu/gemv.py --sweep --out gemv.json
    python benchmarks/gpu/gemv.py --device cpu --tiny --tokens 1 3 --out F.json   # CI smoke
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
import itertools  # noqa: E402
import json  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import astuple  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import roofline  # noqa: E402
import torch  # noqa: E402
from common import TINY, V2_LITE, per_call, run_metadata  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from irminsul.kernels.gemv import GemvTiles, gemv  # noqa: E402

SWEEP = [GemvTiles(16, 128), GemvTiles(16, 256), GemvTiles(16, 512, 4, 3), GemvTiles(32, 256),
         GemvTiles(16, 256, 2, 4), GemvTiles(16, 256, 4, 6), GemvTiles(64, 128)]
L2_BYTES = 2 * 60 * 2**20  # copies of a weight add up to at least this: twice an H200's L2
V3 = dict(hidden_size=7168, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
          qk_nope_head_dim=128, v_head_dim=128, num_attention_heads=128)


def projections(raw: dict[str, Any]) -> dict[str, tuple[int, int, int, bool]]:
    """name → (batch, N, K, batched as the model runs it) of one layer's attention."""
    d, heads, rank = raw["hidden_size"], raw["num_attention_heads"], raw["kv_lora_rank"]
    nope, rope, v = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"], raw["v_head_dim"]
    first = raw["q_lora_rank"] or heads * (nope + rope)
    out = {"joint": (1, first + rank + rope, d, False)}
    if raw["q_lora_rank"]:
        out["q_b_proj"] = (1, heads * (nope + rope), raw["q_lora_rank"], False)
    out.update({"w_uk": (heads, rank, nope, True), "w_uv": (heads, v, rank, True),
                "o_proj": (1, d, heads * v, False)})
    return out


def cell(name: str, shape: tuple[int, int, int, bool], tokens: int, device: str,
         dtype: torch.dtype, copy_gbps: float, repeats: int, calls: int,
         sweep: bool) -> dict[str, Any]:
    batch, n, k, batched = shape
    gen = torch.Generator(device=device).manual_seed(tokens)
    weight_bytes = batch * n * k * torch.tensor([], dtype=dtype).element_size()
    copies = max(1, -(-L2_BYTES // weight_bytes))
    # W_UK is stored [H, nope, rank] and read as x · W_UK, i.e. w = its transpose: the layout
    # the model has, not a contiguous [B, N, K].
    if name == "w_uk":
        weights = [torch.randn(batch, k, n, device=device, generator=gen, dtype=dtype
                               ).transpose(1, 2) for _ in range(copies)]
    else:
        weights = [torch.randn(batch, n, k, device=device, generator=gen, dtype=dtype)
                   for _ in range(copies)]
    x = torch.randn(batch, tokens, k, device=device, generator=gen, dtype=dtype)
    if not batched:
        x, weights = x[0], [w[0] for w in weights]
    floor_ms = weight_bytes / (copy_gbps * 1e9) * 1e3
    row: dict[str, Any] = {"projection": name, "tokens": tokens, "batch": batch, "n": n, "k": k,
                           "weight_bytes": weight_bytes, "floor_ms": floor_ms,
                           "default_tiles": list(astuple(GemvTiles.default(
                               n, k, batch, torch.device(device))))}

    def torch_call(w: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, w.transpose(1, 2)) if batched else torch.nn.functional.linear(x, w)

    def timing(label: str, fn: Callable[[torch.Tensor], Any]) -> None:
        cycle = itertools.cycle(weights)
        try:
            fn(weights[0])  # compiled
        except OutOfResources as err:
            row[label] = str(err)[:80]
            return
        ms = float(np.median([per_call(device, lambda: fn(next(cycle)), calls).device
                              for _ in range(repeats)])) * 1e3
        row[label] = {"ms": ms, "of_copy_bw": floor_ms / ms}

    reference = torch_call(weights[0]).float()
    mine = gemv(x, weights[0]).float()
    row["max_rel_diff"] = float((mine - reference).abs().max() / reference.abs().max())
    timing("torch", torch_call)
    timing("gemv", lambda w: gemv(x, w))
    for tiles in SWEEP if sweep else ():
        timing("gemv n{} k{} w{} s{}".format(*astuple(tiles)),
               lambda w, t=tiles: gemv(x, w, tiles=t))
    runs = {k: v for k, v in row.items() if k.startswith("gemv") and isinstance(v, dict)}
    row["best_gemv"] = min(runs, key=lambda k: runs[k]["ms"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny stand-in in float32")
    parser.add_argument("--v3", action="store_true", help="also DeepSeek-V3's projections")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per timing")
    parser.add_argument("--sweep", action="store_true", help="also a few other tile shapes")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dtype = torch.float32 if args.tiny else torch.bfloat16
    models = {"tiny": TINY} if args.tiny else {"V2-Lite": V2_LITE}
    if args.v3:
        models["V3"] = V3
    copy_gbps = roofline.copy_bandwidth(args.device, nbytes=2**24 if args.tiny else 2**30)
    out: dict[str, Any] = {"meta": run_metadata(args.device), "copy_gbps": copy_gbps,
                           "dtype": str(dtype), "cells": []}
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; ms per call")
    print(f"{'model':>8} {'projection':>10} {'T':>3} {'floor':>7} | {'torch':>7} {'bw':>4} | "
          f"{'gemv':>7} {'bw':>4} | best")
    for model, raw in models.items():
        for name, shape in projections(raw).items():
            for tokens in args.tokens:
                row = cell(name, shape, tokens, args.device, dtype, copy_gbps, args.repeats,
                           args.calls, args.sweep)
                row["model"] = model
                out["cells"].append(row)
                t, g, best = row["torch"], row["gemv"], row[row["best_gemv"]]
                print(f"{model:>8} {name:>10} {tokens:>3} {row['floor_ms']:7.4f} | "
                      f"{t['ms']:7.4f} {t['of_copy_bw']:4.0%} | {g['ms']:7.4f} "
                      f"{g['of_copy_bw']:4.0%} | {row['best_gemv']} {best['ms']:.4f}  "
                      f"diff {row['max_rel_diff']:.1e}", flush=True)
                with open(args.out, "w", encoding="utf-8") as fh:
                    json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
