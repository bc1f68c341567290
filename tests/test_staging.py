"""Uploads through the engine's pinned ring equal the host arrays, whatever the device is doing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from irminsul.engine.staging import Staging


def _rows(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    return [rng.integers(-2**31, 2**31, n) for _ in range(3)]  # int64 arrays of int32 values


def test_cpu_upload_is_the_stacked_rows() -> None:
    rows = _rows(np.random.default_rng(0), 17)
    staging = Staging(torch.device("cpu"), 3, 17)
    got = staging.upload(rows)
    assert got.dtype == torch.int32 and np.array_equal(got.numpy(), np.stack(rows))
    with pytest.raises(ValueError, match="3 rows of 18 values do not fit a staging buffer of "
                                         "3 rows of 17"):
        staging.upload(_rows(np.random.default_rng(0), 18))


@pytest.mark.gpu
def test_ring_never_overwrites_a_queued_copy() -> None:
    """Sixty uploads of varying sizes through a ring of two buffers, each queued
    behind a spin kernel so that its copy is still pending when the host writes the next ones:
    every tensor holds its own rows (a buffer reused too early would hold a later upload's)."""
    rng = np.random.default_rng(1)
    staging = Staging(torch.device("cuda"), 3, 50_060, depth=2)
    sent, got = [], []
    for i in range(60):
        n = int(rng.integers(1, 40_000)) if i % 7 else 50_000 + i
        torch.cuda._sleep(2_000_000)  # the copy waits behind ~1 ms of device work
        sent.append(np.stack(_rows(rng, n)))
        got.append(staging.upload(list(sent[-1])))
    torch.cuda.synchronize()
    for rows, tensor in zip(sent, got):
        assert np.array_equal(tensor.cpu().numpy(), rows)
