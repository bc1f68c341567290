"""Block-scaled float8 weights read as they are stored (DeepSeek-V3's FP8 checkpoints): the tile
dequantization the fused MoE kernel and the linear below share, and a weight-only FP8 linear.

A weight W [N, K] is float8_e4m3fn ``Wq`` and float32 ``scale_inv`` [⌈N/br⌉, ⌈K/bc⌉]:
W[n, k] = float(Wq[n, k]) · scale_inv[n // br, k // bc]. A kernel loads a ``Wq`` tile (one byte a
weight), multiplies it by its scales in float32 and rounds it once to the activations' dtype for
the dot: the arithmetic of dequantizing at load (:func:`irminsul.model.fp8.dequantize_blocks`),
without the dequantized copy. Activations stay in their dtype (w8a16): the weights' bytes are
what a decode step reads.

A decode step's linear has few output tiles (q_a_proj's 1536 outputs are 24 tiles of 64, for
132 SMs), so it also splits the reduction: each program reads a run of whole scale blocks of K
into float32 partials, which a second small kernel sums, adds the bias to and rounds once
(:func:`k_split` says when and how far).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..device import sm_count
from .interpreter import interpreted
from .launch import pdl_args, wait_for_previous


@triton.jit
def dequantize_tile(w, s_ptr, k0, depth, col_ok, BC: tl.constexpr, SCALE_VEC: tl.constexpr,
                    BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """A float8 weight tile [BLOCK_K, BLOCK_N] (reduction index from ``k0``, ``depth`` deep)
    times its block scales (``s_ptr``: each column's row of the grid), in ``dtype`` for the dot:
    the dequantize-at-load arithmetic (float32 product, one rounding)."""
    if SCALE_VEC:  # BLOCK_K divides the block's columns: one scale per column this step
        scale = tl.load(s_ptr + k0 // BC, mask=col_ok, other=0.0)[None, :]
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        scale = tl.load(s_ptr[None, :] + (kk // BC)[:, None],
                        mask=col_ok[None, :] & (kk < depth)[:, None], other=0.0)
    return (w.to(tl.float32) * scale).to(dtype)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(X, W, S, BIAS, Y, M, N, K, K_SPLIT, x_stride, w_stride, s_stride, y_stride,
                   HAS_BIAS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                   SCALE_VEC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   PDL: tl.constexpr):
    wait_for_previous(PDL)
    """One [BLOCK_M, BLOCK_N] tile of y over K columns [pid_k · K_SPLIT, + K_SPLIT) ∩ [0, K).
    ``SPLIT``: the float32 partial goes to Y's slice ``pid_k`` ([splits, M, N], bias left to the
    sum); otherwise the tile is y itself, bias added, rounded once to Y's dtype."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    k_start = pid_k * K_SPLIT  # a multiple of BLOCK_K: the steps below stay aligned to it
    k_end = tl.minimum(K, k_start + K_SPLIT)
    ks = tl.arange(0, BLOCK_K)
    a_ptr = X + rows[:, None].to(tl.int64) * x_stride + (k_start + ks)[None, :]
    # [BLOCK_K, BLOCK_N] of Wᵀ
    w_ptr = W + cols[None, :].to(tl.int64) * w_stride + (k_start + ks)[:, None]
    s_ptr = S + (cols // BR).to(tl.int64) * s_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptr, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < k_end - k0
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        w = dequantize_tile(w, s_ptr, k0, k_end, col_ok, BC, SCALE_VEC, BLOCK_K,
                            X.dtype.element_ty)
        if UPCAST:  # the interpreter multiplies bf16 tiles wrongly: float32 there
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT:  # Y: the partials, contiguous [splits, M, N]
        tile = rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(Y + pid_k.to(tl.int64) * M * N + tile, acc, mask=ok)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows[:, None].to(tl.int64) * y_stride + cols[None, :],
                 acc.to(Y.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["MN"])
def _sum_splits_kernel(P, BIAS, Y, MN, N, SPLITS, HAS_BIAS: tl.constexpr,
                       SPLIT_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
    wait_for_previous(PDL)
    """y = Σ_s P[s] (+ bias) over y's M·N elements as one flat run, the bias once and one
    rounding to Y's dtype. Splits load SPLIT_BLOCK at a time as one [SPLIT_BLOCK, BLOCK] tile;
    the order of the sum is fixed by the launch, so y is the same every call."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    s = tl.arange(0, SPLIT_BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for s0 in range(0, SPLITS, SPLIT_BLOCK):
        part = tl.load(P + (s0 + s)[:, None].to(tl.int64) * MN + i[None, :],
                       mask=(s0 + s < SPLITS)[:, None] & ok[None, :], other=0.0)
        acc += tl.sum(part, axis=0)
    if HAS_BIAS:
        acc += tl.load(BIAS + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + i, acc.to(Y.dtype.element_ty), mask=ok)


Tiles = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages

# When to split K, and how far (measured on an H200 over DeepSeek-V3's linears, 1-512 tokens,
# benchmarks/gpu/fp8.py's shapes): see k_split.
SPLIT_BELOW_WAVES = 1.5  # split only when the output tiles fill fewer waves than this
SPLIT_WAVES = 3  # then aim at this many waves of programs
MIN_SPLIT_DEPTH = 3  # scale blocks of K each split reads at least
MIN_SPLIT_K = 24  # scale blocks of K below which a launch of ≤ 64 rows does not split
MAX_SPLITS = 64  # bounds the sum's tile (splits × columns)
SUM_AT_ONCE = 65536  # outputs up to which the sum loads every split at once


class KSplit(NamedTuple):
    """How a launch divides K: ``splits`` programs per output tile, each reading ``depth``
    columns of K (a multiple of the scale block and of BLOCK_K; the last split may read
    fewer). One split: no partials, y written directly."""

    splits: int
    depth: int


def linear_tiles(tokens: int, dtype: torch.dtype) -> Tiles:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by the rows: the fastest, with
    :func:`k_split`'s splits, of those tried on an H200 over benchmarks/gpu/fp8.py's shapes.
    Up to 64 rows the weight's bytes bound the time: BLOCK_M just covers the rows (16 is
    tl.dot's least), 64 columns a program (32 was within 3% on narrow weights once K is
    split, 5-10% slower on the widest) and a whole 128-column scale block a step, four stages
    in flight. Past 64 rows the dot's arithmetic counts: 128 × 128 tiles (Hopper's wgmma takes
    64 rows a warp group) stepping half a scale block, which leaves shared memory for four
    stages (BLOCK_K 128 with three stages ran 15-45% slower at 512 tokens; eight warps were no
    faster). float32 activations take half the K step."""
    if tokens <= 16:
        tiles = (16, 64, 128, 4, 4)
    elif tokens <= 32:
        tiles = (32, 64, 128, 4, 4)
    elif tokens <= 64:
        tiles = (64, 64, 128, 4, 4)
    else:
        tiles = (128, 128, 64, 4, 4)
    if dtype == torch.float32:
        tiles = (*tiles[:2], tiles[2] // 2, tiles[3], min(tiles[4], 3))
    return tiles


def k_split(m: int, n: int, k: int, tiles: Tiles, block_cols: int, sms: int,
            splits: int | None = None) -> KSplit:
    """The K split of an [m, k] × [k, n] launch in ``tiles`` on ``sms`` SMs.

    Split K only when the output tiles alone fill fewer than :data:`SPLIT_BELOW_WAVES` waves:
    there a few programs each stream a long slab of the weight while most SMs idle (a decode
    step's q_a_proj: 24 tiles of 64 columns). Then aim at :data:`SPLIT_WAVES` waves, each split
    reading at least :data:`MIN_SPLIT_DEPTH` scale blocks, at most :data:`MAX_SPLITS` splits.
    Up to 64 rows, K under :data:`MIN_SPLIT_K` scale blocks is not split: each program's stream
    is short already and the partials' second launch costs more than the split saves (on an
    H200, 3072×1536 and 7168×2048 at 1-64 tokens). On the measured shapes, 1.5 waves rather
    than 2 keeps 224 tiles of 128 × 128 at 512 tokens whole, where the partials' traffic cost
    more than filling the last wave gained. Splits cut K at multiples of lcm(BLOCK_K,
    ``block_cols``): a K step never straddles two scale blocks, a split's scale reads stay
    whole blocks. ``splits``: ask for that many instead (fewer come back where K has fewer
    such runs)."""
    unit = math.lcm(tiles[2], block_cols)
    units = -(-k // unit)
    if splits is None:
        programs = -(-m // tiles[0]) * -(-n // tiles[1])
        if programs >= SPLIT_BELOW_WAVES * sms or (m <= 64 and k < MIN_SPLIT_K * block_cols):
            return KSplit(1, units * unit)
        splits = min(-(-SPLIT_WAVES * sms // programs), units // MIN_SPLIT_DEPTH)
    depth = -(-units // max(1, min(splits, units, MAX_SPLITS))) * unit
    return KSplit(-(-k // depth), depth)


def _sum_splits(partials: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> None:
    """y = partials.sum(0) (+ bias), rounded once to y's dtype, in one launch. A decode step's
    few outputs (≤ :data:`SUM_AT_ONCE`) take all splits in one load, one round trip to memory
    where a loop over them would wait on each (2.6 µs against 3.6 for 14 splits of 1536 on an
    H200); more outputs give enough programs to hide the loop's waits, and a split at a time
    keeps the tile small (5 µs against 25 for 19 splits of 512 × 576)."""
    splits, m, n = partials.shape
    if m * n <= SUM_AT_ONCE:
        split_block = triton.next_power_of_2(splits)
        block = max(32, 4096 // split_block)  # a tile of at most 4096 float32
    else:
        split_block, block = 1, 512
    _sum_splits_kernel[(triton.cdiv(m * n, block),)](
        partials, bias if bias is not None else y, y, m * n, n, splits,
        HAS_BIAS=bias is not None, SPLIT_BLOCK=split_block, BLOCK=block,
        **pdl_args(y.device), num_warps=8 if split_block > 1 else 4)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               block: tuple[int, int], bias: torch.Tensor | None = None,
               tiles: Tiles | None = None, split_k: int | None = None) -> torch.Tensor:
    """y = x · dequant(weight, scale_inv)ᵀ (+ bias), [..., N] in x's dtype: ``weight`` float8_e4m3fn
    [N, K], ``scale_inv`` float32 [⌈N/br⌉, ⌈K/bc⌉] (``block`` = (br, bc)), read as stored;
    products accumulate in float32, rounded once. ``tiles``: a launch shape (default
    :func:`linear_tiles`); ``split_k``: programs along K per output tile (default
    :func:`k_split`'s choice for this device; 1: no split)."""
    n, k = weight.shape
    br, bc = block
    if weight.dtype != torch.float8_e4m3fn or x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         f"{weight.dtype} do not fit (float8_e4m3fn [N, K] wanted)")
    if tuple(scale_inv.shape) != (-(-n // br), -(-k // bc)):
        raise ValueError(f"fp8_linear: scales {tuple(scale_inv.shape)} do not fit weight "
                         f"{tuple(weight.shape)} in blocks {block}")
    if split_k is not None and split_k < 1:
        raise ValueError(f"fp8_linear: split_k {split_k} (1 or more wanted)")
    shape = x.shape
    x = x.reshape(-1, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    weight, scale_inv = weight.contiguous(), scale_inv.float().contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*shape[:-1], n)
    tiles = tiles or linear_tiles(m, x.dtype)
    bm, bn, bk, warps, stages = tiles
    split = k_split(m, n, k, tiles, bc, sm_count(x.device), split_k)
    # Split: float32 partials [splits, m, n], summed below; else the kernel writes y itself.
    out = y if split.splits == 1 else torch.empty(split.splits, m, n, dtype=torch.float32,
                                                  device=x.device)
    upcast = interpreted() and x.dtype != torch.float32
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split.splits)](
        x, weight, scale_inv, bias if bias is not None else y, out, m, n, k, split.depth,
        x.stride(0), weight.stride(0), scale_inv.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BR=br, BC=bc, SCALE_VEC=bc % bk == 0, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, SPLIT=split.splits > 1, UPCAST=upcast,
        PRECISION=precision, **pdl_args(x.device), num_warps=warps, num_stages=stages)
    if split.splits > 1:
        _sum_splits(out, bias, y)
    return y.reshape(*shape[:-1], n)
