"""Weights warmed into L2 while a decode step is latency-bound.

At batch 1 a layer's attention is a chain of small dependent kernels (the latent store, the
attention and its split merge, W_UV, o_proj, the add + norm, the router): tens of µs in which
the memory system is mostly idle. The MoE after it is bandwidth-bound, and the shared experts'
weights are the part of it known before the router runs. :func:`warm` issues L2 prefetches
(``prefetch.global.L2``: fire-and-forget, nothing is loaded into registers) for those weights
from a launch early in the chain, so the fused MoE finds them in L2 instead of DRAM.

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

# Lines of 128 bytes each program prefetches per round, and programs per launch.
BLOCK = 1024
PROGRAMS = 132
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
# The cache policy of the prefetched lines: "evict_last" keeps them over lines loaded since,
# "normal" is plain LRU. A switch for benchmarks' A/B.
POLICY = "evict_last"
_ASM = {"normal": "prefetch.global.L2 [$1]; // $0",
        "evict_last": "prefetch.global.L2::evict_last [$1]; // $0"}


@triton.jit
def _prefetch(PTR, lines, per_program, BLOCK: tl.constexpr, ASM: tl.constexpr):
    base = PTR.to(tl.pointer_type(tl.int8))  # lines counted in bytes, whatever the dtype
    lo = tl.program_id(0) * per_program
    hi = tl.minimum(lo + per_program, lines)
    for first in range(lo, hi, BLOCK):
        # A clamped tail names its last line again: a prefetch writes nothing, so that is free.
        line = tl.minimum(first + tl.arange(0, BLOCK), hi - 1).to(tl.int64)
        tl.inline_asm_elementwise(ASM, "=r,l", [base + line * 128], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit(do_not_specialize=["lines0", "lines1", "lines2", "lines3", "per0", "per1", "per2",
                               "per3"])
def _warm_kernel(P0, P1, P2, P3, lines0, lines1, lines2, lines3, per0, per1, per2, per3,
                 BLOCK: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
    _prefetch(P0, lines0, per0, BLOCK, ASM)
    _prefetch(P1, lines1, per1, BLOCK, ASM)
    _prefetch(P2, lines2, per2, BLOCK, ASM)
    _prefetch(P3, lines3, per3, BLOCK, ASM)
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
    lines = [triton.cdiv(t.numel() * t.element_size(), 128) for t in tensors]
    ptrs = list(tensors)
    while len(ptrs) < SLOTS:  # unused slots: no lines
        ptrs.append(tensors[0])
        lines.append(0)
    per = [max(1, triton.cdiv(n, PROGRAMS)) for n in lines]
    _warm_kernel[(PROGRAMS,)](*ptrs, *lines, *per, BLOCK=BLOCK, ASM=_ASM[POLICY],
                              **pdl_args(tensors[0].device), num_warps=4)
