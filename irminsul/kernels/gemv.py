"""A few rows times a weight: the decode step's projections at batch sizes up to 16 tokens.

At decode sizes a projection is a read of its weight, and how fast it runs is how many programs
stream that weight at once. cuBLAS picks 64-column tiles for one to sixteen rows, so a V2-Lite
layer's joint projection (3,648 × 2,048) runs as 57 programs on an H200's 132 SMs, o_proj as
32, and W_UK / W_UV (16 heads of 128 × 512) as 8–16 per head: every one of them well under the
copy bandwidth over its weight. Here every program takes 16 (or 32) output columns of one batch
entry over the whole reduction, so the same weights are read by hundreds of programs at once.

``y = x · wᵀ`` per batch entry, ``x`` [B, T, K], ``w`` [B, N, K] and ``y`` [B, T, N] through
their strides: a head-major view of a query, a transposed weight, a strided output buffer need
no copy. Products in the weight's precision, accumulated in float32, rounded once to the
output's dtype: what cuBLAS computes, in another order of summation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..device import sm_count
from .interpreter import interpreted

MAX_ROWS = 16  # rows one program holds: tl.dot's least M


@triton.jit
def _gemv_kernel(X, W, Y, rows, n, k, sxb, sxt, sxk, swb, swn, swk, syb, syt, syn,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    col_blk, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    cols = col_blk * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    t_ok, col_ok = t < rows, cols < n
    xs = X + b * sxb + t[:, None] * sxt + ks[None, :] * sxk
    ws = W + b * swb + cols[:, None].to(tl.int64) * swn + ks[None, :] * swk
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        if EVEN_K:
            x = tl.load(xs, mask=t_ok[:, None], other=0.0)
            w = tl.load(ws, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + ks) < k
            x = tl.load(xs, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(ws, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the CPU interpreter's bf16 dot is wrong: multiply in float32 there
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        xs += BLOCK_K * sxk
        ws += BLOCK_K * swk
    ys = Y + b * syb + t[:, None] * syt + cols[None, :] * syn
    tl.store(ys, acc.to(Y.dtype.element_ty), mask=t_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class GemvTiles:
    """One launch's shape: output columns per program, reduction step, warps, stages."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4

    @classmethod
    def default(cls, n: int, k: int, batch: int, device: torch.device) -> GemvTiles:
        """16 columns a program (the most programs) unless that gives more than four programs
        per SM, where 32 columns read each x row half as often for the same weight bytes;
        reduction steps of 256 (or the whole of a shorter K)."""
        programs = triton.cdiv(n, 16) * batch
        block_n = 32 if programs > 4 * sm_count(device) else 16
        return cls(block_n, min(256, max(16, triton.next_power_of_2(k))))


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
         tiles: GemvTiles | None = None) -> torch.Tensor:
    """``x · wᵀ`` for at most :data:`MAX_ROWS` rows: ``x`` [T, K] with ``w`` [N, K] (a linear's
    weight) gives [T, N]; ``x`` [B, T, K] with ``w`` [B, N, K] gives [B, T, N] (a batched
    matmul, ``torch.bmm(x, w.transpose(1, 2))``). Any strides. ``out``: where to write (the
    result's shape, any strides, e.g. columns of a wider buffer); returned. ``tiles``: a launch
    shape other than :meth:`GemvTiles.default` (a benchmark's sweep)."""
    batched = x.dim() == 3
    if x.dim() not in (2, 3) or w.dim() != x.dim() or (batched and w.shape[0] != x.shape[0]):
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)}: want [T, K] and [N, K], "
                         "or [B, T, K] and [B, N, K]")
    rows, k = x.shape[-2:]
    n = w.shape[-2]
    if w.shape[-1] != k:
        raise ValueError(f"x has {k} columns and w rows of {w.shape[-1]}: they must match")
    if rows > MAX_ROWS:
        raise ValueError(f"{rows} rows: gemv takes at most {MAX_ROWS} (a GEMM's work beyond)")
    if not (x.dtype == w.dtype and x.dtype.is_floating_point):
        raise ValueError(f"x is {x.dtype} and w {w.dtype}: want one floating dtype")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} and w on {w.device}")
    shape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != shape or out.device != x.device:
        raise ValueError(f"out is {tuple(out.shape)} on {out.device}, want {shape} on {x.device}")
    if rows == 0 or n == 0:
        return out
    x3, w3, y3 = (x, w, out) if batched else (x[None], w[None], out[None])
    batch = x3.shape[0]
    tiles = tiles or GemvTiles.default(n, k, batch, x.device)
    upcast = interpreted() and x.dtype != torch.float32
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    _gemv_kernel[(triton.cdiv(n, tiles.block_n), batch)](
        x3, w3, y3, rows, n, k, *x3.stride(), *w3.stride(), *y3.stride(),
        BLOCK_T=MAX_ROWS, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        EVEN_K=k % tiles.block_k == 0, UPCAST=upcast, PRECISION=precision,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out
