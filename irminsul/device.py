"""Device helpers shared by the model, the kernels and the engine: getting host data onto the
device without stalling the host, and the device's SM count the kernels size their launches by.
Depends on nothing else in the package, so any layer may import it."""

from __future__ import annotations

import functools

import numpy as np
import torch

SMS = 132  # an H100's or H200's SMs: where the device does not say (a CPU under Triton's interpreter)


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device (:data:`SMS` elsewhere)."""
    device = torch.device(device)
    if device.type != "cuda":
        return SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


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
