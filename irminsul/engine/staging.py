"""A device buffer of int64 inputs written from the host through pinned mirrors pinned once.

The serve path's per-forward inputs — a reuse's source slots, fresh slots and δs; a graph
replay's token ids, positions, kernel layout and key slots — are small host arrays the device
needs before it can run. Uploading each on its own costs a pinning of host memory and a copy
per array: a page-locked buffer and a driver call each, host time spent before a forward the
request is waiting for, and it grows with the number of arrays. Here the caller writes every
array straight into a pinned mirror of one device buffer, at the offsets the device reads them
from, and a copy per contiguous range sends them: no pinning, one or two driver calls.

A mirror is written again only once the copy that last read it is done (a CUDA event); with a
ring of a few mirrors the host waits only when that many copies are still queued behind the
device's work. Off a GPU the buffer is host memory and the caller writes it directly.
"""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    """``size`` int64 values on ``device`` (:attr:`buffer`), written through :meth:`host` and
    sent with :meth:`send`, via a ring of ``depth`` pinned mirrors on a CUDA device."""

    def __init__(self, device: torch.device, size: int, depth: int = 2) -> None:
        self.buffer = torch.zeros(size, dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        self._ring = [torch.zeros(size, dtype=torch.int64, pin_memory=True)
                      for _ in range(depth)] if pinned else []
        # One event per mirror, recorded again after each copy (creating one costs more).
        self._copied = [torch.cuda.Event() for _ in range(depth)] if pinned else []
        self._next = 0

    def host(self) -> np.ndarray:
        """The array to write the next inputs into, at the buffer's offsets: on a GPU the next
        mirror, once the copy that last read it is done; elsewhere the buffer itself."""
        if not self._ring:
            return self.buffer.numpy()
        self._copied[self._next].synchronize()
        return self._ring[self._next].numpy()

    def send(self, *ranges: tuple[int, int]) -> None:
        """Copy the ``[start, end)`` ranges of the array :meth:`host` gave into the buffer,
        queued on the current stream (nothing to do off a GPU)."""
        if not self._ring:
            return
        slot = self._next
        self._next = (slot + 1) % len(self._ring)
        for start, end in ranges:
            if end > start:
                self.buffer[start:end].copy_(self._ring[slot][start:end], non_blocking=True)
        self._copied[slot].record()
