"""δ-rotation of cached k_r rows: gather–rotate–scatter across every layer in one launch.

A reused chunk keeps its c_KV slots; the request gets fresh k_r slots holding the source rows
rotated by δ = p_target − p_source. The rotation of a pair (a, b) by angle θ is
(a cos θ − b sin θ, b cos θ + a sin θ), θ = δ·inv_freq, with cos/sin composed from the rotary's
two-level δ tables (:meth:`Rotary.delta_tables`), so no per-call angle computation and no host work
beyond the index lists. Arithmetic in float32, one rounding to the pool's dtype on store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..model.rope import DELTA_LOW, DELTA_LOW_BITS, Rotary

_LOW = tl.constexpr(DELTA_LOW)
_LOW_BITS = tl.constexpr(DELTA_LOW_BITS)


@triton.jit
def delta_cos_sin(delta, COS, SIN, HI_OFFSET: tl.constexpr, HALF: tl.constexpr,
                  HALF_P2: tl.constexpr):
    """cos, sin [N, HALF_P2] (float32) of the rotation by ``delta`` [N] (int32) positions."""
    cols = tl.arange(0, HALF_P2)
    ok = cols[None, :] < HALF
    lo_row = delta & (_LOW - 1)
    hi_row = (delta >> _LOW_BITS) + (HI_OFFSET + _LOW)
    lo = lo_row[:, None] * HALF + cols[None, :]
    hi = hi_row[:, None] * HALF + cols[None, :]
    c1, s1 = tl.load(COS + lo, mask=ok, other=1.0), tl.load(SIN + lo, mask=ok, other=0.0)
    c2, s2 = tl.load(COS + hi, mask=ok, other=1.0), tl.load(SIN + hi, mask=ok, other=0.0)
    return c1 * c2 - s1 * s2, s1 * c2 + c1 * s2


@triton.jit
def _rotate_kernel(KR, SRC, DST, DELTA, COS, SIN, n, layers, layer_stride,
                   ROPE: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                   HI_OFFSET: tl.constexpr, BLOCK: tl.constexpr, LAYER_GROUP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = rows < n
    src = tl.load(SRC + rows, mask=valid, other=0).to(tl.int64)
    dst = tl.load(DST + rows, mask=valid, other=0).to(tl.int64)
    delta = tl.load(DELTA + rows, mask=valid, other=0)
    # One δ per token, the same in every layer: the angles once, then a pass per layer of this
    # program's group (groups of layers run in parallel programs: more loads in flight).
    cos, sin = delta_cos_sin(delta, COS, SIN, HI_OFFSET, HALF, HALF)
    cols = tl.arange(0, ROPE)[None, :]
    first = tl.program_id(1) * LAYER_GROUP
    # Whole rows load and store contiguously (vectorised); pairs are split apart in registers.
    # The group's layers are unrolled, so their loads are all in flight at once.
    for i in tl.static_range(LAYER_GROUP):
        layer = first + i
        # The layer test as a tensor compare: Triton 3.9's interpreter rejects a mask that
        # combines a scalar compare.
        ok = valid[:, None] & (cols * 0 + layer < layers)
        offset = layer.to(tl.int64) * layer_stride  # a big pool's offsets pass 2^31
        x = tl.load(KR + offset + src[:, None] * ROPE + cols, mask=ok, other=0.0)
        if INTERLEAVED:
            a, b = tl.split(tl.reshape(x, (BLOCK, HALF, 2)))
        else:
            a, b = tl.split(tl.permute(tl.reshape(x, (BLOCK, 2, HALF)), (0, 2, 1)))
        a, b = a.to(tl.float32), b.to(tl.float32)
        y = tl.join(a * cos - b * sin, b * cos + a * sin)  # [BLOCK, HALF, 2]
        if not INTERLEAVED:
            y = tl.permute(y, (0, 2, 1))
        y = tl.reshape(y, (BLOCK, ROPE)).to(KR.dtype.element_ty)
        tl.store(KR + offset + dst[:, None] * ROPE + cols, y, mask=ok)


def pair_layout(rotary: Rotary) -> tuple[int, int]:
    """(step, shift) of rotation pairs in a k_r row: pair i is (i·step, i·step + shift)."""
    return (2, 1) if rotary.interleaved else (1, rotary.dim // 2)


def rotate_kr(kr: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, delta: torch.Tensor,
              rotary: Rotary, *, block: int = 64, group: int = 4, num_warps: int = 4) -> None:
    """kr[:, dst] = kr[:, src] rotated by ``delta`` (one per row), for every layer of the pool
    ``kr`` [layers, slots, rope_dim]; src/dst slots and delta int32 or int64, all on kr's device.
    Source and destination slots must not overlap. ``block`` tokens and ``group`` layers per
    program, ``num_warps`` warps: the launch shape (the default is among the fastest of those
    benchmarks/kernels.py sweeps on an H200: docs/results/2026-11-30-h200-kernels.json)."""
    n = src.numel()
    if n == 0:
        return
    if kr.stride(2) != 1 or kr.stride(1) != rotary.dim:
        raise ValueError("k_r pool must be contiguous in its last two dims")
    if rotary.dim & (rotary.dim - 1) or rotary.dim < 4:
        raise ValueError(f"rope dim {rotary.dim} is not a power of two")
    cos, sin = rotary.delta_tables(kr.device)
    _rotate_kernel[(triton.cdiv(n, block), triton.cdiv(kr.shape[0], group))](
        kr, src, dst, delta, cos, sin, n, kr.shape[0], kr.stride(0), ROPE=rotary.dim,
        HALF=rotary.dim // 2, INTERLEAVED=rotary.interleaved, HI_OFFSET=rotary.hi_offset,
        BLOCK=block, LAYER_GROUP=group, num_warps=num_warps)
