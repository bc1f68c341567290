"""Weights pulled into L2 ahead of the kernel that reads them, while the device is busy with
work that leaves DRAM idle.

A one-token decode step is a chain of small latency-bound launches (norms, the latent store,
the attention over a few MB of KV, its merge) between bandwidth-bound ones (the projections,
the experts). Through the chain's ~30 µs a layer DRAM is mostly idle; the shared experts' 35 MB
that the MoE then reads take ~11 µs of it. :func:`warm` hands such weights to the copy engine
of the memory system — ``cp.async.bulk.prefetch.L2`` (sm_90), one instruction per chunk, no
register or SM time spent waiting — from a launch on a side stream, so nothing in the chain
waits for it and the reads that come later hit L2.

A prefetch has no effect on any value: it only moves bytes into the cache. Off sm_90, off the
GPU and under the interpreter it does nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .interpreter import interpreted

# Where the decoder layer warms its MoE's shared experts at one token, and which of them: a
# switch for benchmarks' A/B ("" off; "layer": as the layer starts; "latent": after the joint
# projection; "attention": before the attention launch) and ("gate_up" or "all").
SPOT = ""
WHAT = "all"
# Bytes per prefetch instruction: 16 KB, a few thousand instructions for a V2-Lite layer.
CHUNK = 16384
# At most this many bytes of each tensor (None: all); 0 launches the same kernels, prefetching
# nothing (what the side stream's launches alone cost).
LIMIT: int | None = None


@triton.jit
def _warm_kernel(BYTES, size, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # One chunk per lane, BLOCK chunks per program: a program's prefetches go through its SM's
    # bulk-copy unit, which moves a few hundred GB/s, so the chunks are spread over many SMs.
    chunks = tl.cdiv(size, CHUNK)
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    start = c.to(tl.int64) * CHUNK
    n = tl.where(c < chunks, tl.minimum(size - start, CHUNK), 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [BYTES + start, n], dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def _side(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


# Devices with warm launches not yet joined: a join with none would make the current stream
# wait on a side stream outside the graph being captured, which capture refuses.
_forked: set[torch.device] = set()


def available(device: torch.device) -> bool:
    """Whether :func:`warm` does anything on ``device`` (a Hopper-or-later GPU, compiled)."""
    return (device.type == "cuda" and not interpreted()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def warm(tensors: Sequence[torch.Tensor]) -> None:
    """Start pulling ``tensors`` (contiguous, each a multiple of 16 bytes) into L2 now, from a
    side stream forked off the current one here; :func:`join` it before a graph capture ends."""
    if not tensors or not available(tensors[0].device):
        return
    main = torch.cuda.current_stream(tensors[0].device)
    side = _side(tensors[0].device)
    side.wait_stream(main)
    _forked.add(tensors[0].device)
    with torch.cuda.stream(side):
        for t in tensors:
            size = t.numel() * t.element_size()
            size = size if LIMIT is None else min(size, LIMIT)
            if not t.is_contiguous() or size % 16:
                raise ValueError(f"warm takes contiguous tensors of 16-byte multiples, got "
                                 f"{tuple(t.shape)} strides {t.stride()} ({size} bytes)")
            _warm_kernel[(max(1, triton.cdiv(triton.cdiv(size, CHUNK), 32)),)](
                t.view(torch.uint8).view(-1), size, CHUNK=CHUNK, BLOCK=32, num_warps=1)


def join(device: torch.device) -> None:
    """The current stream waits for every :func:`warm` launched on ``device`` (a no-op where
    warm does nothing)."""
    if device in _forked:
        _forked.discard(device)
        torch.cuda.current_stream(device).wait_stream(_side(device))
