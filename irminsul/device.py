"""Device helpers shared by the model, the kernels and the engine: getting host data onto the
device without stalling the host. Depends on nothing else in the package, so any layer may import
it."""

from __future__ import annotations

import numpy as np
import torch


def upload(values: np.ndarray, device: torch.device | str, dtype: np.dtype | type = np.int64,
           *, out: torch.Tensor | None = None) -> torch.Tensor:
    """A host array as a tensor on ``device`` (or copied into ``out`` there). To a GPU through
    pinned memory, asynchronously: a copy from pageable memory makes the host wait for the
    device's queue to drain, which would stop the serve path from queueing a forward ahead of
    the device."""
    tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=dtype))
    cuda = torch.device(device).type == "cuda"
    if cuda:
        tensor = tensor.pin_memory()
    if out is None:
        return tensor.to(device, non_blocking=cuda)
    return out.copy_(tensor, non_blocking=cuda)
