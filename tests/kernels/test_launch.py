"""Programmatic dependent launch (irminsul.kernels.launch): kernels launched into each other's
tail must still read what the kernel before them wrote.

A chain of dependent launches — each residual add + norm reads the previous one's outputs — is
captured in a CUDA graph with PDL on and replayed; it must equal, bit for bit, the same chain run
eagerly with plain launches (the same kernel and arithmetic: any difference is a read that
raced its producer). Mode 2 releases each next kernel as soon as the previous one's wait is
done, so a kernel that skipped its wait would run alongside its producer and read stale rows.
"""

from __future__ import annotations

import pytest
import torch

from irminsul.kernels import launch
from irminsul.kernels.fused_norm import add_rms_norm

ON_GPU = pytest.mark.gpu


def test_no_pdl_off_a_hopper_gpu() -> None:
    """CPU tensors (and Triton's interpreter) launch plainly, whatever the mode."""
    assert launch.pdl_mode(torch.device("cpu")) == 0
    assert launch.pdl_args(torch.device("cpu")) == {"PDL": 0, "launch_pdl": False}


def _chain(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
           links: int) -> list[torch.Tensor]:
    outs = []
    for _ in range(links):
        delta, residual = add_rms_norm(delta, residual, weight, 1e-6)
        outs += [delta, residual]
    return outs


@ON_GPU
@pytest.mark.parametrize("mode", [1, 2])
def test_a_graph_of_dependent_launches_equals_plain_launches(mode: int,
                                                              monkeypatch) -> None:
    if not launch._hopper(torch.cuda.current_device()):
        pytest.skip("PDL needs sm_90 or later")
    g = torch.Generator(device="cuda").manual_seed(mode)
    tokens, dim, links = 64, 2048, 40
    delta = torch.randn(tokens, dim, device="cuda", generator=g).to(torch.bfloat16)
    residual = torch.randn(tokens, dim, device="cuda", generator=g).to(torch.bfloat16)
    weight = torch.rand(dim, device="cuda", generator=g) + 0.5

    monkeypatch.setattr(launch, "MODE", 0)
    want = _chain(delta, residual, weight, links)
    monkeypatch.setattr(launch, "MODE", mode)
    assert launch.pdl_args(delta.device) == {"PDL": mode, "launch_pdl": True}
    _chain(delta, residual, weight, 1)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _chain(delta, residual, weight, links)
    for _ in range(3):
        for t in got:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"link {i // 2}: differs from the plain launches"
