"""Block-scaled float8 weights read as they are stored (DeepSeek-V3's FP8 checkpoints): the tile
dequantization the fused MoE kernel and the linear below share, and a weight-only FP8 linear.

A weight W [N, K] is float8_e4m3fn ``Wq`` and float32 ``scale_inv`` [⌈N/br⌉, ⌈K/bc⌉]:
W[n, k] = float(Wq[n, k]) · scale_inv[n // br, k // bc]. A kernel loads a ``Wq`` tile (one byte a
weight), multiplies it by its scales in float32 and rounds it once to the activations' dtype for
the dot: the arithmetic of dequantizing at load (:func:`irminsul.model.fp8.dequantize_blocks`),
without the dequantized copy. Activations stay in their dtype (w8a16): the weights' bytes are
what a decode step reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import interpreted


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


@triton.jit
def _linear_kernel(X, W, S, BIAS, Y, M, N, K, x_stride, w_stride, s_stride, y_stride,
                   HAS_BIAS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                   SCALE_VEC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptr = X + rows[:, None].to(tl.int64) * x_stride + ks[None, :]
    w_ptr = W + cols[None, :].to(tl.int64) * w_stride + ks[:, None]  # [BLOCK_K, BLOCK_N] of Wᵀ
    s_ptr = S + (cols // BR).to(tl.int64) * s_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptr, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptr, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < K - k * BLOCK_K
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        w = dequantize_tile(w, s_ptr, k * BLOCK_K, K, col_ok, BC, SCALE_VEC, BLOCK_K,
                            X.dtype.element_ty)
        if UPCAST:  # the interpreter multiplies bf16 tiles wrongly: float32 there
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = Y + rows[:, None].to(tl.int64) * y_stride + cols[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def linear_tiles(tokens: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by the rows: decode (≤ 16 tokens) streams the
    weight through many narrow programs; prefill reuses each weight tile over 64 rows. float32
    activations take half the K step. Not tuned on a GPU yet."""
    if tokens <= 16:
        tiles = (16, 64, 128, 4, 4)
    elif tokens <= 64:
        tiles = (32, 64, 128, 4, 3)
    else:
        tiles = (64, 128, 64, 8, 3)
    if dtype == torch.float32:
        tiles = (*tiles[:2], tiles[2] // 2, tiles[3], min(tiles[4], 3))
    return tiles


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               block: tuple[int, int], bias: torch.Tensor | None = None,
               tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """y = x · dequant(weight, scale_inv)ᵀ (+ bias), [..., N] in x's dtype: ``weight`` float8_e4m3fn
    [N, K], ``scale_inv`` float32 [⌈N/br⌉, ⌈K/bc⌉] (``block`` = (br, bc)), read as stored;
    products accumulate in float32. ``tiles``: a launch shape (default :func:`linear_tiles`)."""
    n, k = weight.shape
    br, bc = block
    if weight.dtype != torch.float8_e4m3fn or x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                         f"{weight.dtype} do not fit (float8_e4m3fn [N, K] wanted)")
    if tuple(scale_inv.shape) != (-(-n // br), -(-k // bc)):
        raise ValueError(f"fp8_linear: scales {tuple(scale_inv.shape)} do not fit weight "
                         f"{tuple(weight.shape)} in blocks {block}")
    shape = x.shape
    x = x.reshape(-1, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    weight, scale_inv = weight.contiguous(), scale_inv.float().contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*shape[:-1], n)
    bm, bn, bk, warps, stages = tiles or linear_tiles(m, x.dtype)
    upcast = interpreted() and x.dtype != torch.float32
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    _linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, weight, scale_inv, bias if bias is not None else y, y, m, n, k, x.stride(0),
        weight.stride(0), scale_inv.stride(0), y.stride(0), HAS_BIAS=bias is not None, BR=br,
        BC=bc, SCALE_VEC=bc % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        UPCAST=upcast, PRECISION=precision, num_warps=warps, num_stages=stages)
    return y.reshape(*shape[:-1], n)
