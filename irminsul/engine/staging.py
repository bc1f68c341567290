"""Uploads of a reuse's slot lists through pinned host buffers kept between calls.

A reuse uploads its source k_r slots, its fresh slots and its δs (three rows, 100 KB in int32
for an 8K-token reuse) before the rotation runs. :func:`~irminsul.model.paged.upload` pins each array
afresh, and on the lent H200 machines pinning arrays of that size took 0.1–0.4 ms of host time on
the serve path, before a forward the request is waiting for. Here the rows are stacked straight
into a pinned buffer that is kept, and copied from there asynchronously.

A buffer is written again only once the copy that last read it is done (a CUDA event); with a
ring of a few buffers the host waits only when that many copies are still queued behind the
device's work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class Staging:
    """Equal-length integer host rows to one device as one [rows, n] int32 tensor (slots and
    δs fit; half the bytes of int64 to write and copy), through a ring of pinned buffers (on a
    CPU device: a plain copy)."""

    def __init__(self, device: torch.device, depth: int = 4) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._ring: list[torch.Tensor | None] = [None] * depth
        # One event per buffer, recorded again after each copy (creating one costs more).
        self._copied = [torch.cuda.Event() for _ in range(depth)] if self._pinned else []
        self._next = 0

    def upload(self, rows: Sequence[np.ndarray]) -> torch.Tensor:
        """``np.stack(rows)`` as an int32 tensor on the device (copied before it is used there:
        the copy is queued on the current stream). Values must fit in int32."""
        if not self._pinned:
            return torch.from_numpy(np.stack(rows).astype(np.int32)).to(self.device)
        slot = self._next
        self._next = (slot + 1) % len(self._ring)
        size = len(rows) * len(rows[0])
        buffer = self._ring[slot]
        if buffer is None or buffer.numel() < size:
            # Grown geometrically: pinning a buffer is the slow step this class exists to avoid.
            buffer = self._ring[slot] = torch.empty(
                max(size, 2 * buffer.numel() if buffer is not None else 4096),
                dtype=torch.int32, pin_memory=True)
        self._copied[slot].synchronize()  # the last copy from this buffer has read it
        host = buffer[:size].view(len(rows), -1)
        np.stack(rows, out=host.numpy())
        out = host.to(self.device, non_blocking=True)
        self._copied[slot].record()
        return out
