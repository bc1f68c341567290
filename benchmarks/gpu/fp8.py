"""FP8 weights read as float8: the weight-only kernels against their memory floor and bf16.

DeepSeek-V3's block-quantized weights (float8_e4m3fn, one float32 scale per 128 × 128 block),
random, at the shapes one rank of eight holds (`docs/multi-gpu.md`: attention split by heads,
experts by expert parallel, 32 of 256 per rank) and at the whole model's. Per token count T,
device time per call (``common.per_call``, median of repeats) of

    linears   ``kernels.fp8.fp8_linear`` (float8 read, tiles dequantized in registers) against
              F.linear on the bf16 weight (what dequantizing at load keeps resident) and
              FP8Linear's torch path (dequantize the whole weight, then F.linear: what a rank
              would do every forward without the kernel)
    experts   ``kernels.fused_moe.fused_experts`` with float8 experts and their scales against
              the same kernel over bf16 experts; real top-8 routing over 256 experts. ``ep``: the
              32 experts of rank 0 (``first=0``; other assignments skipped in the kernel);
              ``all``: all 256 on one GPU

each scored against its floor: the float8 bytes it must read (weights touched, plus scales) over
the measured copy bandwidth, so "of copy bw" = floor / time. Outputs are checked against the bf16
path (max relative difference). Prints tables and writes JSON (``--out``).

    python benchmarks/gpu/fp8.py --out docs/results/gpu-fp8.json
    python benchmarks/gpu/fp8.py --device cpu --tiny --tokens 1 3 --out F.json   # CI smoke
"""

from __future__ import annotations

import os
import sys

if "--device=cpu" in sys.argv or any(a == "--device" and b == "cpu"
                                     for a, b in zip(sys.argv, sys.argv[1:])):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import roofline  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import per_call, run_metadata  # noqa: E402

from irminsul.kernels import fused_moe  # noqa: E402
from irminsul.kernels.fp8 import fp8_linear  # noqa: E402
from irminsul.model.fp8 import dequantize_blocks, dequantize_stacked  # noqa: E402

BLOCK = (128, 128)
# (name, out N, in K) of one rank of 8 at DeepSeek-V3's shapes (hidden 7168, 128 heads, q_lora
# 1536, kv_lora 512 + rope 64, dense intermediate 18432): q_a and kv_a are whole on every rank.
V3_RANK_LINEARS = [("q_a_proj", 1536, 7168), ("q_b_proj / 8", 3072, 1536),
                   ("kv_a_proj_with_mqa", 576, 7168), ("o_proj / 8", 7168, 2048),
                   ("dense gate_up / 8", 4608, 7168), ("dense down / 8", 7168, 2304),
                   ("o_proj whole", 7168, 16384)]
V3_EXPERTS = {"hidden": 7168, "inter": 2048, "experts": 256, "topk": 8, "ranks": 8}
TINY_LINEARS = [("tiny", 96, 256)]
TINY_EXPERTS = {"hidden": 256, "inter": 128, "experts": 8, "topk": 2, "ranks": 2}


def random_fp8(shape: tuple[int, ...], device: str, gen: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float8 weights (values of a unit normal, clipped to e4m3's range) and their
    positive block scales (~1/448 · 0.02: weights of ~0.02 after the multiply)."""
    w = torch.randn(shape, device=device, generator=gen).clamp_(-448, 448).to(torch.float8_e4m3fn)
    grid = (*shape[:-2], -(-shape[-2] // BLOCK[0]), -(-shape[-1] // BLOCK[1]))
    scale = (torch.rand(grid, device=device, generator=gen) + 0.5) * (0.02 / 448 * 100)
    return w, scale


def timing(device: str, fn: Any, floor_ms: float, repeats: int, calls: int) -> dict[str, float]:
    fn()  # compiled, memory allocated
    ms = float(np.median([per_call(device, fn, calls).device for _ in range(repeats)])) * 1e3
    return {"ms": ms, "of_copy_bw": floor_ms / ms}


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are all zero: a rank none of whose experts
    the tokens chose)."""
    scale = float(want.float().abs().max())
    diff = float((got.float() - want.float()).abs().max())
    return diff / scale if scale else diff


def linear_cells(shapes: list[tuple[str, int, int]], tokens: list[int], device: str,
                 dtype: torch.dtype, copy_gbps: float, repeats: int, calls: int
                 ) -> list[dict[str, Any]]:
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, n, k in shapes:
        w, s = random_fp8((n, k), device, gen)
        dense = dequantize_blocks(w, s, BLOCK).to(dtype)
        floor_ms = (w.nbytes + s.nbytes) / (copy_gbps * 1e9) * 1e3
        for t in tokens:
            x = torch.randn(t, k, device=device, generator=gen).to(dtype)
            row: dict[str, Any] = {"name": name, "out": n, "in": k, "tokens": t,
                                   "floor_ms": floor_ms,
                                   "bf16_floor_ms": dense.nbytes / (copy_gbps * 1e9) * 1e3}
            row["max_rel_diff"] = rel_diff(fp8_linear(x, w, s, BLOCK), F.linear(x, dense))
            paths = {"fp8": lambda x=x, w=w, s=s: fp8_linear(x, w, s, BLOCK),
                     "bf16": lambda x=x, dense=dense: F.linear(x, dense),
                     "dequantize_then_linear": lambda x=x, w=w, s=s: F.linear(
                         x, dequantize_blocks(w, s, BLOCK).to(dtype))}
            for label, fn in paths.items():
                row[label] = timing(device, fn, floor_ms, repeats, calls)
            rows.append(row)
            print(f"{name:>20} {t:>5} {floor_ms:7.4f} | fp8 {row['fp8']['ms']:7.4f} "
                  f"{row['fp8']['of_copy_bw']:4.0%} | bf16 {row['bf16']['ms']:7.4f} | dequant+linear "
                  f"{row['dequantize_then_linear']['ms']:7.4f} | diff {row['max_rel_diff']:.1e}",
                  flush=True)
        del dense
    return rows


def expert_cells(shape: dict[str, int], tokens: list[int], device: str, dtype: torch.dtype,
                 copy_gbps: float, repeats: int, calls: int) -> list[dict[str, Any]]:
    gen = torch.Generator(device=device).manual_seed(1)
    dim, inter, experts, k = shape["hidden"], shape["inter"], shape["experts"], shape["topk"]
    w13, s13 = random_fp8((experts, 2 * inter, dim), device, gen)
    w2, s2 = random_fp8((experts, dim, inter), device, gen)
    rows = []
    local = experts // shape["ranks"]
    for scope, count in (("ep", local), ("all", experts)):
        q13, q2 = w13[:count], w2[:count]
        scales = fused_moe.ExpertScales(s13[:count].contiguous(), s2[:count].contiguous(), BLOCK)
        b13 = dequantize_stacked(q13, scales.w13, BLOCK, parts=2).to(dtype)
        b2 = dequantize_blocks(q2, scales.w2, BLOCK).to(dtype)
        first = 0 if scope == "ep" else None
        expert_bytes = q13[0].nbytes + q2[0].nbytes + scales.w13[0].nbytes + scales.w2[0].nbytes
        for t in tokens:
            x = torch.randn(t, dim, device=device, generator=gen).to(dtype)
            logits = torch.randn(t, experts, device=device, generator=gen)
            weights, ids = logits.softmax(-1).topk(k, dim=-1)
            touched = int(torch.unique(ids[ids < count]).numel())
            floor_ms = touched * expert_bytes / (copy_gbps * 1e9) * 1e3

            def fp8_call(x=x, weights=weights, ids=ids, q13=q13, q2=q2, scales=scales,
                         first=first) -> torch.Tensor:
                return fused_moe.fused_experts(x, q13, q2, weights, ids, scales=scales,
                                               first=first)

            def bf16_call(x=x, weights=weights, ids=ids, b13=b13, b2=b2, first=first
                          ) -> torch.Tensor:
                return fused_moe.fused_experts(x, b13, b2, weights, ids, first=first)

            row: dict[str, Any] = {"scope": scope, "experts": count, "tokens": t,
                                   "experts_touched": touched, "floor_ms": floor_ms,
                                   "max_rel_diff": rel_diff(fp8_call(), bf16_call())}
            row["fp8"] = timing(device, fp8_call, floor_ms, repeats, calls)
            row["bf16"] = timing(device, bf16_call, floor_ms, repeats, calls)
            rows.append(row)
            print(f"{scope:>4} {count:>4} {t:>5} {touched:>4} {floor_ms:7.3f} | fp8 "
                  f"{row['fp8']['ms']:7.3f} {row['fp8']['of_copy_bw']:4.0%} | bf16 "
                  f"{row['bf16']['ms']:7.3f} ({floor_ms / row['bf16']['ms']:4.0%} of the fp8 "
                  f"floor) | diff {row['max_rel_diff']:.1e}", flush=True)
        del b13, b2
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, float32 (CPU smoke)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per timing")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dtype = torch.float32 if args.tiny else torch.bfloat16
    copy_gbps = roofline.copy_bandwidth(args.device, nbytes=2**24 if args.tiny else 2**30)
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; ms per call")
    linears = linear_cells(TINY_LINEARS if args.tiny else V3_RANK_LINEARS, args.tokens,
                           args.device, dtype, copy_gbps, args.repeats, args.calls)
    experts = expert_cells(TINY_EXPERTS if args.tiny else V3_EXPERTS, args.tokens, args.device,
                           dtype, copy_gbps, args.repeats, args.calls)
    out = {"meta": run_metadata(args.device), "copy_gbps": copy_gbps, "block": list(BLOCK),
           "dtype": str(dtype), "linears": linears, "experts": experts,
           "expert_shape": TINY_EXPERTS if args.tiny else V3_EXPERTS}
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
