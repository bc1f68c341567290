"""δ-rotation of cached k_r rows: gather–rotate–scatter across every layer in one launch.

A reused chunk keeps its c_KV slots; the request gets fresh k_r slots holding the source rows
rotated by δ = p_target − p_source. The rotation of a pair (a, b) by angle θ is
(a cos θ − b sin θ, b cos θ + a sin θ), θ = δ·inv_freq, with cos/sin composed from two-level δ
tables (a fine table indexed by δ's low bits, a coarse one by the rest; the model's rotary makes
them: ``Rotary.delta_tables``), so no per-call angle computation and no host work beyond the index
lists. Arithmetic in float32, one rounding to the pool's dtype on store.

The kernels take tensors and integers only: this package imports nothing from the model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import pdl_args, wait_for_previous


@triton.jit
def delta_cos_sin(delta, COS, SIN, HI_OFFSET: tl.constexpr, LOW_BITS: tl.constexpr,
                  HALF: tl.constexpr, HALF_P2: tl.constexpr):
    """cos, sin [N, HALF_P2] (float32) of the rotation by ``delta`` [N] (int32) positions: the
    fine row ``δ mod 2^LOW_BITS`` composed with the coarse row ``2^LOW_BITS + HI_OFFSET +
    (δ >> LOW_BITS)``."""
    low = 1 << LOW_BITS
    cols = tl.arange(0, HALF_P2)
    ok = cols[None, :] < HALF
    lo_row = delta & (low - 1)
    hi_row = (delta >> LOW_BITS) + (HI_OFFSET + low)
    lo = lo_row[:, None] * HALF + cols[None, :]
    hi = hi_row[:, None] * HALF + cols[None, :]
    c1, s1 = tl.load(COS + lo, mask=ok, other=1.0), tl.load(SIN + lo, mask=ok, other=0.0)
    c2, s2 = tl.load(COS + hi, mask=ok, other=1.0), tl.load(SIN + hi, mask=ok, other=0.0)
    return c1 * c2 - s1 * s2, s1 * c2 + c1 * s2


@triton.jit(do_not_specialize=["n"])
def _rotate_kernel(KR, ROT, COUNT, COS, SIN, n, layers, layer_stride,
                   ROPE: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                   HI_OFFSET: tl.constexpr, LOW_BITS: tl.constexpr, BLOCK: tl.constexpr,
                   LAYER_GROUP: tl.constexpr, COUNTED: tl.constexpr,
                   PDL: tl.constexpr):
    wait_for_previous(PDL)
    if COUNTED:  # the row count on the device: a captured launch serves any count
        n = tl.load(COUNT)
    cols = tl.arange(0, ROPE)[None, :]
    first = tl.program_id(1) * LAYER_GROUP
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        _rotate_rows(KR, ROT, COS, SIN, n, start + tl.arange(0, BLOCK), cols, first, layers,
                     layer_stride, ROPE, HALF, INTERLEAVED, HI_OFFSET, LOW_BITS, BLOCK,
                     LAYER_GROUP)


@triton.jit
def _rotate_rows(KR, ROT, COS, SIN, n, rows, cols, first, layers, layer_stride,
                 ROPE: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                 HI_OFFSET: tl.constexpr, LOW_BITS: tl.constexpr, BLOCK: tl.constexpr,
                 LAYER_GROUP: tl.constexpr):
    valid = rows < n
    src = tl.load(ROT + rows, mask=valid, other=0).to(tl.int64)
    dst = tl.load(ROT + n + rows, mask=valid, other=0).to(tl.int64)
    delta = tl.load(ROT + 2 * n + rows, mask=valid, other=0).to(tl.int32)
    # One δ per token, the same in every layer: the angles once, then a pass per layer of this
    # program's group (groups of layers run in parallel programs: more loads in flight).
    cos, sin = delta_cos_sin(delta, COS, SIN, HI_OFFSET, LOW_BITS, HALF, HALF)
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


def pair_layout(dim: int, interleaved: bool) -> tuple[int, int]:
    """(step, shift) of rotation pairs in a ``dim``-wide k_r row: pair i is (i·step, i·step +
    shift) — interleaved pairs (2i, 2i+1), else half-split (i, i + dim/2)."""
    return (2, 1) if interleaved else (1, dim // 2)


def rotate_kr(kr: torch.Tensor, rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              hi_offset: int, low_bits: int, dim: int, interleaved: bool, *,
              count: torch.Tensor | None = None, programs: int | None = None, block: int = 64,
              group: int = 4, num_warps: int = 4) -> None:
    """kr[:, dst] = kr[:, src] rotated by δ (one per row) for every layer of the pool ``kr``
    [layers, slots, dim]. ``rot`` (int32 or int64, on kr's device) holds the rows' source
    slots, destination slots and δs back to back: src | dst | δ, n each. ``count``: a device
    scalar giving n, read by the kernel (``rot`` may then be longer: room for any n up to
    a third of it) — so a CUDA graph of this launch serves any count; else n = len(rot) / 3.
    Source and destination slots must not overlap.

    The rotation: ``cos`` / ``sin`` (float32 [2^low_bits + 2·hi_offset + 1, dim/2], on kr's
    device) hold the angles of every δ below 2^low_bits in their first rows and of every
    multiple of 2^low_bits from −hi_offset to +hi_offset after them; pairs are laid out per
    ``interleaved`` (:func:`pair_layout`). A model's rotary gives these arguments in this order
    (``Rotary.kernel_args``).

    ``programs`` row-block programs per layer group (default: one per block of ``block`` rows
    that fit ``rot``), each walking every ``programs``-th block; ``group`` layers per program,
    ``num_warps`` warps: the launch shape (the default is among the fastest of those
    benchmarks/gpu/attention_kernels.py sweeps on an H200: docs/results/gpu-kernels.json)."""
    if kr.stride(2) != 1 or kr.stride(1) != dim:
        raise ValueError("k_r pool must be contiguous in its last two dims")
    if dim & (dim - 1) or dim < 4:
        raise ValueError(f"rope dim {dim} is not a power of two")
    rows = (1 << low_bits) + 2 * hi_offset + 1
    if cos.shape != (rows, dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"δ tables of shape {tuple(cos.shape)} / {tuple(sin.shape)}, want "
                         f"{(rows, dim // 2)}")
    n = rot.numel() // 3
    if n == 0:
        return
    programs = programs or triton.cdiv(n, block)
    _rotate_kernel[(programs, triton.cdiv(kr.shape[0], group))](
        kr, rot, rot if count is None else count, cos, sin, n, kr.shape[0], kr.stride(0),
        ROPE=dim, HALF=dim // 2, INTERLEAVED=interleaved, HI_OFFSET=hi_offset,
        LOW_BITS=low_bits, BLOCK=block, LAYER_GROUP=group, COUNTED=count is not None,
        **pdl_args(kr.device), num_warps=num_warps)
