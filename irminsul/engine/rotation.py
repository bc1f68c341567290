"""The device work of a reuse: cached k_r rows rotated by δ into a request's fresh slots.

A reuse's rows — source slots, fresh slots, δs — go to the device through one staging buffer
laid out ``[n | src | dst | δ]`` (:class:`~.staging.Staging`: no pinning, one copy), and the
rotation kernel reads its row count there. So on CUDA its launch is captured once, as a graph
sized for the longest prompt, and every reuse replays it: launching a Triton kernel from Python
(binding its arguments, finding the compiled variant) costs host time on the path to the forward
the request is waiting for, and a replay is one driver call.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
import triton

from ..kernels import rotate_kr
from ..model.rope import Rotary
from .graphs import capture
from .staging import Staging

BLOCK = 64  # rows per block of the rotation kernel (rotate_kr's default)
MAX_PROGRAMS = 1024  # a captured launch's row-block programs (each walks every 1024th block)


class Rotation:
    """Rotates up to ``max_rows`` rows of the pool ``kr`` [layers, slots, rope_dim] per call,
    replaying a CUDA graph of the launch on a CUDA device (elsewhere: launched each call)."""

    def __init__(self, kr: torch.Tensor, rotary: Rotary, max_rows: int) -> None:
        self.kr, self.max_rows = kr, max_rows
        # The kernel's view of the rotary, its δ tables made on the pool's device once, here.
        self._rotary_args = rotary.kernel_args(kr.device)
        self.staging = Staging(kr.device, 1 + 3 * max_rows)
        self._graph: torch.cuda.CUDAGraph | None = None
        if kr.device.type == "cuda":
            self._graph = self._capture()

    def __call__(self, src: np.ndarray, dst: np.ndarray, deltas: np.ndarray) -> None:
        """kr[:, dst] := kr[:, src] rotated by ``deltas``, every layer (queued on the current
        stream). Source and destination slots must not overlap."""
        n = len(src)
        if n > self.max_rows:
            raise ValueError(f"a reuse of {n} rows exceeds the rotation's room of "
                             f"{self.max_rows}")
        host = self.staging.host()
        host[0] = n
        host[1:1 + n], host[1 + n:1 + 2 * n], host[1 + 2 * n:1 + 3 * n] = src, dst, deltas
        self.staging.send((0, 1 + 3 * n))
        if self._graph is not None:
            self._graph.replay()
        else:
            self._launch(triton.cdiv(n, BLOCK))

    def _launch(self, programs: int) -> None:
        buffer = self.staging.buffer
        rotate_kr(self.kr, buffer[1:], *self._rotary_args, count=buffer[:1], programs=programs,
                  block=BLOCK)

    def _capture(self) -> torch.cuda.CUDAGraph:
        """The launch for any count up to ``max_rows``, captured after a launch of none (the
        buffer's count is still 0: the kernel compiled, nothing rotated)."""
        programs = min(triton.cdiv(self.max_rows, BLOCK), MAX_PROGRAMS)
        return capture(partial(self._launch, programs))[0]
