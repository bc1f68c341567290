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
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from .interpreter import interpreted

MODE = 1  # see the module's docstring; benchmarks set it for an A/B


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_mode(device: torch.device) -> int:
    """The :data:`MODE` a launch on ``device`` runs with: 0 where PDL does not exist."""
    if MODE == 0 or device.type != "cuda" or interpreted():
        return 0
    return MODE if _hopper(device.index if device.index is not None
                           else torch.cuda.current_device()) else 0


def pdl_args(device: torch.device) -> dict[str, Any]:
    """The launch keywords of a kernel that calls :func:`wait_for_previous` first."""
    mode = pdl_mode(device)
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
def release_next(PDL: tl.constexpr):
    """Let the next grid launch now, before this one's programs exit (mode 1 releases it as they
    exit; mode 2 has already, in :func:`wait_for_previous`). For a kernel whose successor has
    programs that need nothing it writes (:func:`~irminsul.kernels.router.route_aligned`'s
    shared experts): they run beside this grid instead of after it."""
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
