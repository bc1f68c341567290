"""Programmatic dependent launch (PDL): the decode step's kernels launched into each other's tail.

A decode step at batch 1 is ~420 kernels of a few µs each. Between two stream-ordered kernels the
device waits for the first grid to finish and flush, then launches the second. Launched with
PDL (``launch_pdl``, Hopper and later; CUDA graphs keep it as a programmatic edge), the second
grid's programs are scheduled as the first one's exit and each waits in ``griddepcontrol.wait``
for the first grid's completion and its writes before its first load: launch and prologue
overlap the tail, the order of every read and write stays that of the stream. Every kernel
here waits before it reads or writes anything another launch touches.

:data:`MODE` says how: 0 plain launches; 1 wait first (the next kernel is released as this one's
programs exit); 2 also release the next kernel right after the wait, so its programs can be
resident while this one runs (they then hold SM room this one's later programs could use).
Off the GPU, under Triton's interpreter and before sm_90 it is 0.

What a launch reads that no recent grid wrote it may ask of L2 before its wait
(:func:`prefetch_l2`; :data:`PREFETCH` says which launches do): the decode attention its first
key rows, a short launch the weights of the launches after it (:func:`weight_prefetch`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from .interpreter import interpreted

MODE = 1  # see the module's docstring; benchmarks set it for an A/B
# What launches fetch into L2 before their wait (prefetch_l2): "keys", the attention's first key
# rows; "weights", the weights of the launches after a short one (see weight_prefetch). Off until
# a GPU measures it (benchmarks/gpu/decode.py --prefetch keys weights, an A/B).
PREFETCH: frozenset[str] = frozenset()
PREFETCH_MAX_TOKENS = 16  # batches up to this many tokens prefetch weights: latency-bound steps
PREFETCH_PARTS = 16  # programs a launch adds to fetch weights, each a share of their bytes


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_mode(device: torch.device) -> int:
    """The :data:`MODE` a launch on ``device`` runs with: 0 where PDL does not exist."""
    if MODE == 0 or device.type != "cuda" or interpreted():
        return 0
    return MODE if _hopper(device.index if device.index is not None
                           else torch.cuda.current_device()) else 0


def pdl_args(device: torch.device, release: bool = False) -> dict[str, Any]:
    """The launch keywords of a kernel that calls :func:`wait_for_previous` first. ``release``:
    release the next kernel right after the wait whatever :data:`MODE` says (where PDL is on),
    for a short launch of few programs whose successor has work to do before its own wait
    (:func:`prefetch_l2`)."""
    mode = pdl_mode(device)
    if release and mode:
        mode = 2
    return {"PDL": mode, "launch_pdl": mode > 0}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """First in a kernel: wait for the previous grid (and its writes) when launched with PDL;
    then, at mode 2, release the next one."""
    if PDL >= 1:
        tl.extra.cuda.gdc_wait()
    if PDL >= 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines holding ``ptrs`` (any shape); nothing comes back. Before
    :func:`wait_for_previous` this overlaps a read's latency with the previous grid: L2 is
    where the device's writes meet, so a line fetched early that the previous grid then writes
    is read afterwards with its new bytes, and a wrong address costs a wasted line, never a
    wrong value (addresses must still lie in allocated memory)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


def prefetching(kind: str, device: torch.device) -> bool:
    """Whether launches on ``device`` prefetch ``kind`` ("keys" or "weights"): named in
    :data:`PREFETCH`, and PDL on (the prefetch overlaps the previous grid only there)."""
    return kind in PREFETCH and pdl_mode(device) > 0


def weight_prefetch(weights: Sequence[torch.Tensor], tokens: int, like: torch.Tensor
                    ) -> dict[str, Any]:
    """The keywords of a launch with :func:`prefetch_weights` programs: up to two weights
    (contiguous; others are skipped) that the launches after it read, fetched into L2 by
    :data:`PREFETCH_PARTS` programs added to its grid, while it and the launches before those
    run — a batch of few tokens leaves memory bandwidth idle in its short launches (norms, the
    latent store, attention over a few rows), and spends it afterwards reading these weights.
    None for batches above :data:`PREFETCH_MAX_TOKENS` tokens (PF_PARTS 0). ``like``: any
    tensor of the launch, passed where a weight is missing (0 bytes: never read)."""
    views = [w.reshape(-1).view(torch.uint8) for w in weights if w.is_contiguous()][:2]
    on = bool(views) and tokens <= PREFETCH_MAX_TOKENS and prefetching("weights", like.device)
    pairs = [(v, v.numel()) for v in views] if on else []
    pairs += [(like, 0)] * (2 - len(pairs))
    return {"PF_A": pairs[0][0], "pf_a_bytes": pairs[0][1], "PF_B": pairs[1][0],
            "pf_b_bytes": pairs[1][1], "PF_PARTS": PREFETCH_PARTS if on else 0}


@triton.jit
def _prefetch_share(BASE, nbytes, part, PARTS: tl.constexpr):
    lines = tl.cdiv(nbytes, 128)
    per = tl.cdiv(lines, PARTS)
    first = part * per
    last = tl.minimum(first + per, lines)
    for i in range(first, last, 1024):
        at = tl.minimum(i + tl.arange(0, 1024), last - 1)  # the last step's spare lanes repeat
        prefetch_l2(BASE + at.to(tl.int64) * 128)


@triton.jit
def prefetch_weights(PF_A, pf_a_bytes, PF_B, pf_b_bytes, PF_PARTS: tl.constexpr):
    """Whether this program is one of the last ``PF_PARTS`` of its (1-D) grid, the prefetch
    programs of :func:`weight_prefetch`; if so, its share of both weights' bytes is now asked
    of L2 and the caller returns. Called before the wait: weights are no grid's output."""
    working = tl.num_programs(0) - PF_PARTS
    part = tl.program_id(0) - working
    if part >= 0:
        _prefetch_share(PF_A, pf_a_bytes, part, PF_PARTS)
        _prefetch_share(PF_B, pf_b_bytes, part, PF_PARTS)
    return part >= 0
