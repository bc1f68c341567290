"""Weights pulled into L2 ahead of the kernel that reads them, on a side stream.

A batch-1 decode layer is a chain of latency-bound kernels (the latent store, attention, its
merge, the router: ~25 µs a layer on an H100, moving little memory) between bandwidth-bound
GEMVs whose weights are cold every step (a step reads ~3 GB; L2 holds 50 MB). While that chain
runs, DRAM idles: a kernel on a side stream can issue ``prefetch.global.L2::evict_last`` for the
weights read next (o_proj, the shared experts), so those GEMVs read L2. Prefetches return no
data: a few programs cover megabytes. CUDA only (inline PTX; not under Triton's interpreter).

Off by default, an experiment: on an H100 a prefetched o_proj GEMV took 5.3 µs against 7.4 cold
(benchmarks/gpu/l2_prefetch.py), yet decode steps that forked and joined the side stream in every
layer were 1.4–6.6% slower at batch 1–8 (``decode.py --prefetch``; the join cut the layers'
programmatic launches). The side stream now joins once per forward: not yet measured.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LINE = 128  # bytes per prefetch: an L2 line
PROGRAMS = 32  # enough in flight to stream at DRAM speed, few enough to leave the chain its SMs
BLOCK = 512  # prefetches per program and step
ENABLED = False  # decode layers prefetch their later weights (an experiment: benchmarks set it)
WEIGHTS = ("o_proj", "gate", "up", "down")  # which: o_proj's, the shared experts' three
PREFETCH_TOKENS = 8  # forwards of up to this many tokens prefetch (decode steps of few requests)


@triton.jit
def _prefetch_kernel(BASE, nbytes, SINK, LINE_B: tl.constexpr, BLOCK_P: tl.constexpr):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    seen = tl.zeros([BLOCK_P], tl.int32)
    for start in range(pid * BLOCK_P * LINE_B, nbytes, programs * BLOCK_P * LINE_B):
        at = tl.minimum(start + tl.arange(0, BLOCK_P).to(tl.int64) * LINE_B, nbytes - 1)
        seen += tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [BASE + at],
            dtype=tl.int32, is_pure=False, pack=1)
    tl.store(SINK + pid, tl.sum(seen, 0))  # zero: keeps the prefetches from being dropped


@functools.cache
def _sink(device: torch.device, programs: int) -> torch.Tensor:
    """Where a launch of up to ``programs`` programs stores its zeros."""
    return torch.zeros(programs, dtype=torch.int32, device=device)


def prefetch_l2(tensors: list[torch.Tensor], programs: int = PROGRAMS) -> None:
    """Issue L2 prefetches for every byte of ``tensors`` (contiguous CUDA tensors) on the
    current stream; reads nothing back and writes nothing the caller sees."""
    for t in tensors:
        if t.device.type != "cuda" or not t.is_contiguous():
            raise ValueError(f"prefetch_l2 takes contiguous CUDA tensors, got {t.device} "
                             f"{tuple(t.shape)} stride {t.stride()}")
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            continue
        flat = t.view(-1).view(torch.uint8)
        _prefetch_kernel[(min(programs, triton.cdiv(nbytes, BLOCK * LINE)),)](
            flat, nbytes, _sink(t.device, programs), LINE_B=LINE, BLOCK_P=BLOCK, num_warps=4)


@functools.cache
def side_stream(device: torch.device) -> SidePrefetch:
    """The device's one prefetch stream (every layer's forward uses it in turn)."""
    return SidePrefetch(device)


class SidePrefetch:
    """A side stream that prefetches weights while the current stream computes: :meth:`start`
    forks (the side stream waits for the current one's work so far, then prefetches), :meth:`join`
    makes the current stream wait for the side stream — needed before a CUDA graph's capture
    ends, never for correctness (prefetches change no data)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.pending = False  # prefetches started since the last join

    def start(self, tensors: list[torch.Tensor]) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            prefetch_l2(tensors)
        self.pending = True

    def join(self) -> None:
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self.pending = False


def join_side_stream(device: torch.device) -> None:
    """The current stream waits for the device's prefetch stream, if anything was started on
    it since the last join: once per forward, at its end (a join inside the layers' chain would
    cut its programmatic launches: an H100 measured the per-layer join up to 6.6% slower at
    batch 1)."""
    if side_stream.cache_info().currsize and side_stream(device).pending:
        side_stream(device).join()
