"""The engine's staging buffer holds what the host wrote into it, whatever the device is doing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from irminsul.engine.staging import Staging


def test_cpu_host_array_is_the_buffer() -> None:
    staging = Staging(torch.device("cpu"), 10)
    host = staging.host()
    host[2:5] = [7, -8, 2**40]
    staging.send((2, 5))
    assert staging.buffer.tolist() == [0, 0, 7, -8, 2**40, 0, 0, 0, 0, 0]


@pytest.mark.gpu
def test_ring_never_overwrites_a_queued_copy() -> None:
    """Sixty writes of varying ranges through a ring of two mirrors, each copy queued behind a
    spin kernel so that it is still pending when the host writes the next ones: each snapshot
    of the buffer, taken on the device right after its copy, holds its own values (a mirror
    written again too early would hand a copy a later write's values)."""
    rng = np.random.default_rng(1)
    size = 50_000
    staging = Staging(torch.device("cuda"), size, depth=2)
    sent, got = [], []
    for i in range(60):
        n = int(rng.integers(1, 40_000)) if i % 7 else size - i
        start = int(rng.integers(0, size - n + 1))
        torch.cuda._sleep(2_000_000)  # the copy waits behind ~1 ms of device work
        sent.append(rng.integers(-2**62, 2**62, n))
        staging.host()[start:start + n] = sent[-1]
        staging.send((start, start + n))
        got.append(staging.buffer[start:start + n].clone())  # ordered after the copy
    torch.cuda.synchronize()
    for values, tensor in zip(sent, got):
        assert np.array_equal(tensor.cpu().numpy(), values)
