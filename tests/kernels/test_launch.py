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


def test_weight_prefetch_only_for_short_batches_with_pdl(monkeypatch) -> None:
    """Prefetch programs join a launch only where PDL is on, "weights" is asked for and the
    batch is at most PREFETCH_MAX_TOKENS tokens; they cover the contiguous weights' bytes, at
    most two, and a missing weight is 0 bytes of the launch's own tensor."""
    big, small = torch.zeros(64, 32), torch.zeros(8, dtype=torch.bfloat16)
    skewed = torch.zeros(32, 64).t()  # not contiguous: skipped
    like = torch.zeros(3)
    monkeypatch.setattr(launch, "PREFETCH", frozenset({"keys", "weights"}))
    assert launch.weight_prefetch([big], 1, like)["PF_PARTS"] == 0  # a CPU: no PDL
    monkeypatch.setattr(launch, "pdl_mode", lambda device: 1)
    on = launch.weight_prefetch([skewed, big, small, big], 1, like)
    assert on["PF_PARTS"] == launch.PREFETCH_PARTS
    assert (on["pf_a_bytes"], on["pf_b_bytes"]) == (64 * 32 * 4, 8 * 2)
    assert on["PF_A"].data_ptr() == big.data_ptr() and on["PF_A"].dtype == torch.uint8
    one = launch.weight_prefetch([big], launch.PREFETCH_MAX_TOKENS, like)
    assert one["PF_PARTS"] > 0 and one["pf_b_bytes"] == 0 and one["PF_B"] is like
    long = launch.weight_prefetch([big], launch.PREFETCH_MAX_TOKENS + 1, like)
    assert long["PF_PARTS"] == 0 and long["pf_a_bytes"] == 0
    monkeypatch.setattr(launch, "PREFETCH", frozenset({"keys"}))
    assert launch.weight_prefetch([big], 1, like)["PF_PARTS"] == 0
    assert launch.prefetching("keys", torch.device("cpu"))


def _chain(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
           links: int, prefetch: tuple[torch.Tensor, ...] = ()) -> list[torch.Tensor]:
    outs = []
    for _ in range(links):
        delta, residual = add_rms_norm(delta, residual, weight, 1e-6, prefetch=prefetch)
        outs += [delta, residual]
    return outs


@ON_GPU
@pytest.mark.parametrize("mode,tokens", [(1, 64), (2, 64), (1, 8), (2, 8)])
def test_a_graph_of_dependent_launches_equals_plain_launches(mode: int, tokens: int,
                                                              monkeypatch) -> None:
    """At 8 tokens each launch also has prefetch programs (a 32 MB weight), which stop before
    the wait: the chain must still read every producer's rows."""
    if not launch._hopper(torch.cuda.current_device()):
        pytest.skip("PDL needs sm_90 or later")
    monkeypatch.setattr(launch, "PREFETCH", frozenset({"keys", "weights"}))
    g = torch.Generator(device="cuda").manual_seed(mode)
    dim, links = 2048, 40
    delta = torch.randn(tokens, dim, device="cuda", generator=g).to(torch.bfloat16)
    residual = torch.randn(tokens, dim, device="cuda", generator=g).to(torch.bfloat16)
    weight = torch.rand(dim, device="cuda", generator=g) + 0.5
    fetched = (torch.zeros(4096, dim, device="cuda", dtype=torch.float32),)

    monkeypatch.setattr(launch, "MODE", 0)
    want = _chain(delta, residual, weight, links)
    monkeypatch.setattr(launch, "MODE", mode)
    assert launch.pdl_args(delta.device) == {"PDL": mode, "launch_pdl": True}
    assert (launch.weight_prefetch(fetched, tokens, delta)["PF_PARTS"] > 0) == (tokens <= 16)
    _chain(delta, residual, weight, 1, fetched)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _chain(delta, residual, weight, links, fetched)
    for _ in range(3):
        for t in got:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"link {i // 2}: differs from the plain launches"


@ON_GPU
@pytest.mark.parametrize("mode,requests", [(1, 2), (2, 2), (1, 16)])
def test_attention_after_the_latent_store_reads_its_new_rows(mode: int, requests: int,
                                                             monkeypatch) -> None:
    """The decode attention fetches its keys' rows before its wait and the latent store before
    it releases it early; the rows the store writes (each request's last key) must still be
    read new. A graph of store + attention, replayed over three inputs, equals plain launches
    without prefetch, bit for bit (2 requests: the split launch; 16: the pieces)."""
    import numpy as np

    from irminsul.kernels import PagedLayout, paged_mla_attention, store_latent

    if not launch._hopper(torch.cuda.current_device()):
        pytest.skip("PDL needs sm_90 or later")
    dev, rank, rope, heads, slots = "cuda", 512, 64, 16, 60000
    g = torch.Generator(device=dev).manual_seed(requests)
    rng = np.random.default_rng(requests)
    keys = [4096, 700] if requests == 2 else list(rng.integers(100, 3000, requests))
    rows = rng.permutation(slots)
    idx = [rows[a:a + k] for a, k in zip(np.cumsum([0] + keys[:-1]), keys)]
    new = torch.tensor([i[-1] for i in idx], device=dev)
    ckv = torch.randn(slots, rank, device=dev, generator=g).to(torch.bfloat16)
    kr = torch.randn(slots, rope, device=dev, generator=g).to(torch.bfloat16)
    q = (torch.randn(requests, heads, rank + rope, device=dev, generator=g) * 0.1).to(
        torch.bfloat16)
    norm = torch.rand(rank, device=dev, generator=g).to(torch.bfloat16) + 0.5
    angles = torch.rand(requests, rope // 2, device=dev, generator=g) * 6
    cis = torch.view_as_real(torch.polar(torch.ones_like(angles), angles))
    inputs = [torch.randn(requests, rank + rope, device=dev, generator=g).to(torch.bfloat16)
              for _ in range(3)]
    kv_a = inputs[0].clone()
    layout = PagedLayout.build([1] * requests, idx, idx, heads, dev)
    assert (layout.schedule is not None) == (requests == 16)

    def step() -> torch.Tensor:
        store_latent(kv_a, norm, 1e-6, cis, False, ckv, kr, new, new)
        return paged_mla_attention(q, ckv, kr, layout, 0.1)

    monkeypatch.setattr(launch, "MODE", 0)
    monkeypatch.setattr(launch, "PREFETCH", frozenset())
    want = []
    for x in inputs:
        kv_a.copy_(x)
        want.append(step().clone())
    monkeypatch.setattr(launch, "MODE", mode)
    monkeypatch.setattr(launch, "PREFETCH", frozenset({"keys", "weights"}))
    step()  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    for i, x in enumerate(inputs):
        ckv[new] = 0
        kv_a.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want[i]), f"input {i}: differs from plain launches"
