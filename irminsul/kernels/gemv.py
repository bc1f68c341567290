"""A decode step's projections whose weights are read before the launch before them ends.

At decode sizes a projection is a read of its weight: a V2-Lite layer's joint q/kv_a projection
is 15 MB, o_proj 8 MB, W_UV 2 MB, for one to a few rows of x. cuBLAS reads them well once it
runs, but it launches plainly: it starts only after the kernel before it has finished and
flushed, and its weight stream starts cold after that (in the step each call takes ~6.8 µs for
~5 µs of bytes on an H100). The weight depends on nothing the step computes, so here each
program loads its whole weight tile (``BLOCK_N`` output columns × all of K, ≤ 64 KB, held in
registers) *before* ``griddepcontrol.wait``, and reads x only after it. Launched with
programmatic dependent launch, its programs become resident as the previous grid drains; where
that grid releases this one early (:func:`~.launch.release_next`, as the residual add + norm
before the joint projection does, and as W_UV's launch does for o_proj), they stream the weight
while it still runs — what the MoE's shared experts do beside the router.

:func:`normed_gemv` also folds the residual add + RMSNorm before a decode layer's first
projection into its launch: one dependent launch and one round trip of x fewer a layer.

``y = x · wᵀ`` per batch entry: ``x`` [B, T, K], ``w`` [B, N, K], ``y`` [B, T, N], any strides
(a head-major view of the attention output, a strided output buffer: no copies). Products and
sums in float32, rounded once to the output's dtype: what cuBLAS computes, in another order of
summation. Only shapes whose tile fits (:func:`tiles`) run here; the caller keeps cuBLAS for
the rest (DeepSeek-V3's 7168-wide K, prefill sizes).

:data:`MAX_TOKENS`, :data:`PRELOAD` and :data:`FOLDS_NORM` are switches a benchmark flips for an A/B.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import sm_count
from .fused_norm import _round
from .interpreter import interpreted
from .launch import pdl_args, release_next, wait_for_previous

# Batches of up to this many tokens project here (0: cuBLAS always). H100, a step at 4K: one
# token 2.82 -> 2.71 ms, two 3.87 -> 3.86, four 5.32 -> 5.46, eight 7.67 -> 8.18 (each row is
# another pass over the tile: docs/results/gpu-decode-gemv-*.json).
MAX_TOKENS = 1
PRELOAD = True  # load the weight tile before waiting for the previous grid (False: after)
TILE_BYTES = 64 * 1024  # the most weight one program holds in registers
MAX_ROWS = 16  # rows of x one launch takes (a decode batch's tokens)
# The add + norm before the joint projection run in its launch (normed_gemv), the MoE's down
# releasing it. H100, batch 1: 2.67 -> 2.61 ms a step at 4K, 2.94 -> 2.86 at 16K (docs/design.md,
# "The input norm in the joint projection's launch").
FOLDS_NORM = True


@triton.jit
def _normed_row(X, t, sxt, sxk, DELTA, sd0, sd1, sd2, NORM_W, SUMMED, eps, ks, write,
                K: tl.constexpr, TERMS: tl.constexpr, BY_HAND: tl.constexpr):
    """Row t of norm(x + Σ delta) as float32 (rounded to x's dtype first, as
    :func:`~.fused_norm.add_rms_norm` rounds it), the rounded sum written to SUMMED where
    ``write``: that kernel's arithmetic, step for step."""
    dtype = SUMMED.dtype.element_ty
    d = tl.zeros([K], tl.float32)
    for j in tl.static_range(TERMS):
        d += tl.load(DELTA + t * sd0 + j * sd1 + ks * sd2).to(tl.float32)
    if TERMS > 1:
        d = _round(d, dtype, BY_HAND).to(tl.float32)
    summed = _round(tl.load(X + t * sxt + ks * sxk).to(tl.float32) + d, dtype, BY_HAND)
    if write:
        tl.store(SUMMED + t * K + ks, summed)
    s = summed.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s * s, 0) / K + eps)
    nw = _round(tl.load(NORM_W + ks).to(tl.float32), dtype, BY_HAND).to(tl.float32)
    return _round(s * inv * nw, dtype, BY_HAND).to(tl.float32)


@triton.jit
def _gemv_kernel(X, W, Y, rows, n, sxb, sxt, sxk, swb, swn, swk, syb, syt, syn,
                 DELTA, sd0, sd1, sd2, NORM_W, SUMMED, eps,
                 K: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                 PRELOAD: tl.constexpr, RELEASE: tl.constexpr, BY_HAND: tl.constexpr,
                 NORM: tl.constexpr, TERMS: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, K)
    ok = cols < n
    ws = W + b * swb + cols[:, None].to(tl.int64) * swn + ks[None, :] * swk
    if PRELOAD:  # nothing the previous grids write: read it while they run
        w = tl.load(ws, mask=ok[:, None], other=0.0)
    wait_for_previous(PDL)
    if RELEASE:
        release_next(PDL)
    if not PRELOAD:
        w = tl.load(ws, mask=ok[:, None], other=0.0)
    for t in tl.static_range(ROWS):
        if t < rows:
            if NORM:  # every program norms the row itself; the first writes the sum
                x = _normed_row(X, t, sxt, sxk, DELTA, sd0, sd1, sd2, NORM_W, SUMMED, eps, ks,
                                tl.program_id(0) == 0, K, TERMS, BY_HAND)
            else:
                x = tl.load(X + b * sxb + t * sxt + ks * sxk).to(tl.float32)
            y = tl.sum(w.to(tl.float32) * x[None, :], 1)
            tl.store(Y + b * syb + t * syt + cols * syn,
                     _round(y, Y.dtype.element_ty, BY_HAND), mask=ok)


def tiles(n: int, k: int, batch: int, dtype: torch.dtype, device: torch.device
          ) -> tuple[int, int] | None:
    """(output columns a program, warps) of a launch over ``batch`` [N, K] weights, or None
    where no tile fits: K not a power of two, or 16 columns of K over :data:`TILE_BYTES`. The
    widest tile (up to 64 columns) that still gives every SM a program, so the weight is read
    by as many programs at once as the device holds."""
    size = torch.empty((), dtype=dtype).element_size()
    if k < 16 or k & (k - 1) or 16 * k * size > TILE_BYTES:
        return None
    block = 64
    while block > 16 and (block * k * size > TILE_BYTES
                          or triton.cdiv(n, block) * batch < sm_count(device)):
        block //= 2
    return block, 8 if block * k * size >= 32 * 1024 else 4


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`gemv` takes ``x`` [T, K] or [B, T, K] with ``w`` [N, K] or [B, N, K]:
    :func:`takes` of its rows and dtype, and as many dimensions as ``w``."""
    return x.dim() == w.dim() and takes(x.shape[-2], x.dtype, w)


def takes(rows: int, dtype: torch.dtype, w: torch.Tensor) -> bool:
    """Whether :func:`gemv` takes ``rows`` rows of ``dtype`` times ``w``: at most
    :data:`MAX_TOKENS` (and :data:`MAX_ROWS`) rows, one floating dtype, a tile that fits."""
    return (0 < rows <= min(MAX_TOKENS, MAX_ROWS) and dtype == w.dtype
            and dtype.is_floating_point
            and tiles(w.shape[-2], w.shape[-1], w.shape[0] if w.dim() == 3 else 1, w.dtype,
                      w.device) is not None)


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
         release: bool = False) -> torch.Tensor:
    """``x · wᵀ``: ``x`` [T, K] with ``w`` [N, K] (a linear's weight) gives [T, N]; ``x``
    [B, T, K] with ``w`` [B, N, K] gives [B, T, N] (``torch.bmm(x, w.transpose(1, 2))``). Any
    strides. ``out``: where to write (the result's shape, any strides); returned. ``release``:
    let the next launch start as soon as this one's programs have waited (for a next launch
    that, like this one, reads its weights first). Raises ValueError where :func:`fits` is
    False."""
    batched = x.dim() == 3
    if x.dim() not in (2, 3) or w.dim() != x.dim() or (batched and w.shape[0] != x.shape[0]):
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)}: want [T, K] and [N, K], "
                         "or [B, T, K] and [B, N, K]")
    rows, k = x.shape[-2:]
    n = w.shape[-2]
    if w.shape[-1] != k:
        raise ValueError(f"x has {k} columns and w rows of {w.shape[-1]}: they must match")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} and w on {w.device}")
    if not fits(x, w):
        raise ValueError(f"x {x.dtype} {tuple(x.shape)} and w {w.dtype} {tuple(w.shape)}: want "
                         f"1..{min(MAX_TOKENS, MAX_ROWS)} rows, one floating dtype, K a power "
                         f"of two with 16 rows of K within {TILE_BYTES} bytes")
    shape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != shape or out.device != x.device:
        raise ValueError(f"out is {tuple(out.shape)} on {out.device}, want {shape} on {x.device}")
    x3, w3, y3 = (x, w, out) if batched else (x[None], w[None], out[None])
    _launch(x3, w3, y3, release)
    return out


def _launch(x3: torch.Tensor, w3: torch.Tensor, y3: torch.Tensor, release: bool,
            norm: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None = None) -> None:
    """The kernel over [B, T, K] · [B, N, K]ᵀ → [B, T, N]; ``norm`` (terms [T, J, K], norm
    weight, eps, summed [T, K]; B = 1): x is a residual the add + norm still apply to."""
    rows, k = x3.shape[-2:]
    n = w3.shape[-2]
    block, warps = tiles(n, k, w3.shape[0], w3.dtype, w3.device)
    terms, norm_w, eps, summed = norm if norm is not None else (x3, x3, 0.0, x3)
    _gemv_kernel[(triton.cdiv(n, block), w3.shape[0])](
        x3, w3, y3, rows, n, *x3.stride(), *w3.stride(), *y3.stride(),
        terms, *(terms.stride() if norm is not None else (0, 0, 0)), norm_w, summed, eps,
        K=k, BLOCK_N=block, ROWS=triton.next_power_of_2(rows), PRELOAD=PRELOAD, RELEASE=release,
        BY_HAND=interpreted(), NORM=norm is not None,
        TERMS=terms.shape[1] if norm is not None else 1, **pdl_args(x3.device),
        num_warps=warps)


def normed_gemv(residual: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor,
                eps: float, w: torch.Tensor, summed: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, summed): ``summed = residual + delta`` and ``y = F.rms_norm(summed, (K,),
    norm_weight, eps) · wᵀ``, in one launch — the residual add + norm before a decode layer's
    joint projection (:func:`~.fused_norm.add_rms_norm`'s arithmetic, its output never stored)
    folded into the GEMV that reads it. Each program norms the row itself (K values from L2)
    after its wait, so the launch before it (the MoE's down, which releases it) is the only
    one the projection waits for. ``residual`` [T, K] and ``delta`` [T, K] or [T, J, K] terms
    summed first (the MoE's outputs); ``w`` [N, K]; ``summed``: where the sum goes (a
    contiguous [T, K]; a new one if None).
    Raises ValueError where :func:`takes` is False for ``w`` or the shapes do not fit."""
    if residual.dim() != 2 or w.dim() != 2:
        raise ValueError(f"residual {tuple(residual.shape)} and w {tuple(w.shape)}: want [T, K] "
                         "and [N, K]")
    tokens, k = residual.shape
    terms = delta if delta.dim() == 3 else delta[:, None]
    if terms.dim() != 3 or (terms.shape[0], terms.shape[2]) != (tokens, k) or w.shape[1] != k:
        raise ValueError(f"residual {tuple(residual.shape)}, delta {tuple(delta.shape)} and w "
                         f"{tuple(w.shape)} do not fit: want [T, K], [T, K] or [T, J, K], and "
                         "[N, K]")
    if tuple(norm_weight.shape) != (k,) or delta.dtype != residual.dtype:
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} (want [{k}]) or delta "
                         f"{delta.dtype} (want {residual.dtype}) does not fit")
    if len({residual.device, delta.device, w.device, norm_weight.device}) != 1:
        raise ValueError("residual, delta, norm weight and w must share a device")
    if not takes(tokens, residual.dtype, w):
        raise ValueError(f"{tokens} rows of {residual.dtype} times w {w.dtype} "
                         f"{tuple(w.shape)}: not a GEMV shape (see takes)")
    if summed is None:
        summed = torch.empty(tokens, k, dtype=residual.dtype, device=residual.device)
    elif (tuple(summed.shape) != (tokens, k) or not summed.is_contiguous()
          or summed.dtype != residual.dtype or summed.device != residual.device):
        raise ValueError(f"summed is {summed.dtype} {tuple(summed.shape)}, want a contiguous "
                         f"{residual.dtype} {(tokens, k)} on {residual.device}")
    out = torch.empty(tokens, w.shape[0], dtype=residual.dtype, device=residual.device)
    _launch(residual[None], w[None], out[None], False,
            (terms, norm_weight.contiguous(), eps, summed))
    return out, summed
