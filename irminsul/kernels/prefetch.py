"""Weights warmed into L2 while a decode step is latency-bound.

At batch 1 a layer's attention is a chain of small dependent kernels (the latent store, the
attention and its split merge, W_UV, o_proj, the add + norm, the router): tens of µs in which
the memory system is mostly idle. The MoE after it is bandwidth-bound, and the shared experts'
weights are the part of it known before the router runs. :func:`warm` issues L2 prefetches
(bulk ones by default: the copy engine fetches each range, nothing is loaded into registers)
for those weights from a launch early in the chain, so the fused MoE finds them in L2 instead
of DRAM.

A prefetch changes no value anywhere; it only moves bytes into the cache. The launch still
keeps the stream's order: its programs wait for the previous grid *after* issuing their
prefetches, so the next launch's wait covers everything before this one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .launch import pdl_args, wait_for_previous

# Programs per launch, and units each program names per round.
PROGRAMS = 132
BLOCK = 1024
# Forwards of up to this many tokens warm the shared experts (decode steps: latency-bound
# attention); 0 turns warming off. Off until an A/B on a GPU says it pays.
MAX_TOKENS = 0
# Tensors one launch takes.
SLOTS = 4
# The attention's own o_proj weight warmed with them, and the shared down projection (A/B
# switches: L2 holds 50 MB on an H100 or H200, and a V2-Lite layer's shared experts and o_proj
# are 43 MB).
WITH_O_PROJ = True
WITH_DOWN = True
# The next layer's joint projection warmed by a launch before the router's (A/B switch).
FOLLOWING = False
# How: "bulk", one cp.async.bulk.prefetch.L2 per BULK_BYTES (the copy engine walks the range,
# so a program issues a few instructions and is done); "lines", one prefetch.global.L2 per
# 128-byte line (every line an instruction of the program's, held up when the memory system's
# queues are full). A switch for benchmarks' A/B.
METHOD = "bulk"
BULK_BYTES = 32768
_UNIT = {"bulk": BULK_BYTES, "lines": 128}


@triton.jit
def _prefetch(PTR, nbytes, per_program, BLOCK: tl.constexpr, UNIT: tl.constexpr,
              BULK: tl.constexpr):
    base = PTR.to(tl.pointer_type(tl.int8))  # counted in bytes, whatever the dtype
    units = tl.cdiv(nbytes, UNIT)
    lo = tl.program_id(0) * per_program
    hi = tl.minimum(lo + per_program, units)
    for first in range(lo, hi, BLOCK):
        unit = first + tl.arange(0, BLOCK)
        at = unit.to(tl.int64) * UNIT
        if BULK:
            # Sizes in whole 16 bytes, as the instruction takes them (a tail under 16 bytes
            # stays cold); lanes past the range name nothing.
            size = (tl.minimum(nbytes - at, UNIT) // 16 * 16).to(tl.int32)
            go = ((unit < hi) & (size > 0)).to(tl.int32)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; } // $0", "=r,l,r,r",
                [base + at, size, go], dtype=tl.int32, is_pure=False, pack=1)
        else:
            # A clamped tail names its last line again: a prefetch writes nothing.
            line = tl.minimum(unit, hi - 1).to(tl.int64) * UNIT
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l",
                                      [base + line], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["bytes0", "bytes1", "bytes2", "bytes3", "per0", "per1", "per2",
                               "per3"])
def _warm_kernel(P0, P1, P2, P3, bytes0, bytes1, bytes2, bytes3, per0, per1, per2, per3,
                 BLOCK: tl.constexpr, UNIT: tl.constexpr, BULK: tl.constexpr,
                 PDL: tl.constexpr):
    _prefetch(P0, bytes0, per0, BLOCK, UNIT, BULK)
    _prefetch(P1, bytes1, per1, BLOCK, UNIT, BULK)
    _prefetch(P2, bytes2, per2, BLOCK, UNIT, BULK)
    _prefetch(P3, bytes3, per3, BLOCK, UNIT, BULK)
    # Last, not first: the prefetches need nothing an earlier launch writes, but the next
    # launch waits only for this grid, so this grid must not finish before the previous one.
    wait_for_previous(PDL)


def warm(tensors: Sequence[torch.Tensor]) -> None:
    """Prefetch up to :data:`SLOTS` contiguous CUDA tensors into L2 in one launch (nothing is
    read back, nothing written; a graph captures it). Tensors elsewhere are left alone."""
    if len(tensors) > SLOTS:
        raise ValueError(f"warm takes up to {SLOTS} tensors, got {len(tensors)}")
    for i, t in enumerate(tensors):
        if not t.is_contiguous() or t.device != tensors[0].device:
            raise ValueError(f"warm needs contiguous tensors on one device: tensor {i} is on "
                             f"{t.device} with strides {t.stride()}")
    if not tensors or tensors[0].device.type != "cuda":
        return
    unit = _UNIT[METHOD]
    nbytes = [t.numel() * t.element_size() for t in tensors]
    ptrs = list(tensors)
    while len(ptrs) < SLOTS:  # unused slots: no bytes
        ptrs.append(tensors[0])
        nbytes.append(0)
    per = [max(1, triton.cdiv(triton.cdiv(n, unit), PROGRAMS)) for n in nbytes]
    # Bulk: one lane a thread of one warp (a layout wider than the block would repeat lanes,
    # and each repeat would prefetch its range again).
    bulk = METHOD == "bulk"
    _warm_kernel[(PROGRAMS,)](*ptrs, *nbytes, *per, BLOCK=32 if bulk else BLOCK, UNIT=unit,
                              BULK=bulk, **pdl_args(tensors[0].device),
                              num_warps=1 if bulk else 4)
