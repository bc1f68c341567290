"""Uploads of a reuse's slot lists through pinned host buffers pinned once, when the engine starts.

A reuse uploads its source k_r slots, its fresh slots and its δs (three rows, 100 KB in int32
for an 8K-token reuse) before the rotation runs. :func:`~irminsul.model.paged.upload` pins each array
afresh, and on the lent H200 machines pinning arrays of that size took 0.1–0.4 ms of host time on
the serve path, before a forward the request is waiting for; pinning a new buffer there (to grow
one) takes longer still. Here the rows are stacked straight into a buffer pinned at start, sized
for the longest reuse a prompt can hold, and copied from there asynchronously.

A buffer is written again only once the copy that last read it is done (a CUDA event); with a
ring of a few buffers the host waits only when that many copies are still queued behind the
device's work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class Staging:
    """Up to ``rows`` equal-length integer host rows of at most ``length`` values to one device,
    as one [rows, n] int32 tensor (slots and δs fit; half the bytes of int64 to write and copy),
    through a ring of ``depth`` pinned buffers (on a CPU device: a plain copy)."""

    def __init__(self, device: torch.device, rows: int, length: int, depth: int = 4) -> None:
        self.device, self.rows, self.length = device, rows, length
        pinned = device.type == "cuda"
        self._ring = [torch.empty(rows * length, dtype=torch.int32, pin_memory=True)
                      for _ in range(depth)] if pinned else []
        # One event per buffer, recorded again after each copy (creating one costs more).
        self._copied = [torch.cuda.Event() for _ in range(depth)] if pinned else []
        self._next = 0

    def upload(self, rows: Sequence[np.ndarray]) -> torch.Tensor:
        """``np.stack(rows)`` as an int32 tensor on the device (copied before it is used there:
        the copy is queued on the current stream). Values must fit in int32."""
        if len(rows) > self.rows or len(rows[0]) > self.length:
            raise ValueError(f"{len(rows)} rows of {len(rows[0])} values do not fit a staging "
                             f"buffer of {self.rows} rows of {self.length}")
        if not self._ring:
            return torch.from_numpy(np.stack(rows).astype(np.int32)).to(self.device)
        slot = self._next
        self._next = (slot + 1) % len(self._ring)
        self._copied[slot].synchronize()  # the last copy from this buffer has read it
        host = self._ring[slot][:len(rows) * len(rows[0])].view(len(rows), -1)
        np.stack(rows, out=host.numpy())
        out = host.to(self.device, non_blocking=True)
        self._copied[slot].record()
        return out
