"""The greedy argmax kernel (irminsul/kernels/argmax.py) against torch.argmax, whose answer it
must give exactly: the first index of the maximum, NaN above every number. Runs on CUDA, or on a
CPU under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rows_with_edges(vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows, then rows built to trip a wrong answer: the maximum repeated in two chunks
    and inside one, at the last entry, a NaN after a +inf, two NaNs, all -inf, a +inf alone,
    -inf in half the row."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(10, vocab, generator=gen).to(dtype)
    last = vocab - 1
    x[1, 5] = x[1, last] = 50.0  # tie across chunks: the first
    x[2, 7] = x[2, 9] = 60.0  # tie inside a chunk
    x[3, last] = 70.0  # the very last entry (a masked tail's neighbour)
    x[4, 3] = float("inf")
    x[4, last] = float("nan")  # NaN beats +inf, wherever it is
    x[5, last // 2] = float("nan")
    x[5, last] = float("nan")  # the first NaN
    x[6] = float("-inf")  # nothing above -inf: index 0
    x[7, 0] = 80.0  # the first entry
    x[8, 2] = float("inf")
    x[9, :vocab // 2] = float("-inf")  # a finite maximum still
    return x


@pytest.mark.parametrize("vocab", [1, 100, 4096, 4097, 9000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_argmax_rows_is_torch_argmax(vocab: int, dtype: torch.dtype) -> None:
    from irminsul.kernels.argmax import argmax_rows

    x = rows_with_edges(max(vocab, 10), dtype)[:, :vocab]
    got = argmax_rows(x.to(DEVICE)).cpu()
    assert got.dtype == torch.int64
    want = x.float().argmax(-1)
    # torch's CPU argmax is the reference here; check the hand-built rows by hand as well.
    assert torch.equal(got, want), (got, want)
    if vocab >= 100:
        assert got[1] == 5 and got[2] == 7 and got[3] == vocab - 1 and got[4] == vocab - 1
        assert got[5] == (vocab - 1) // 2 and got[6] == 0 and got[7] == 0


@pytest.mark.parametrize("vocab", [1, 100, 4097, 9000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_argmax_rows_says_which_rows_are_finite(vocab: int, dtype: torch.dtype) -> None:
    """With ``finite``: the same ids, and 0 exactly for the rows whose maximum is a NaN, a +inf
    or -inf (no token to pick), against torch's value at torch's argmax."""
    from irminsul.kernels.argmax import argmax_rows

    x = rows_with_edges(max(vocab, 10), dtype)[:, :vocab]
    got = argmax_rows(x.to(DEVICE), finite=True).cpu()
    assert got.shape == (2, 10) and got.dtype == torch.int64
    want = x.float().argmax(-1)
    assert torch.equal(got[0], want)
    assert got[1].tolist() == x.float().gather(-1, want[:, None])[:, 0].isfinite().tolist()
    if vocab >= 100:
        assert got[1].tolist() == [1, 1, 1, 1, 0, 0, 0, 1, 0, 1]
    assert argmax_rows(torch.empty(0, 5, device=DEVICE), finite=True).shape == (2, 0)


def test_strided_and_empty() -> None:
    from irminsul.kernels.argmax import argmax_rows

    wide = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    x = wide[:, 10:260]  # row stride 300
    assert torch.equal(argmax_rows(x.to(DEVICE)).cpu(), x.argmax(-1))
    assert argmax_rows(torch.empty(0, 5, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match="float logits"):
        argmax_rows(torch.zeros(3, dtype=torch.int32, device=DEVICE))


def test_greedy_tokens_uses_it_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's greedy path: the kernel for CUDA rows, torch elsewhere; same ids, and
    the same finite flags (a NaN row, an all -inf row)."""
    from irminsul.engine import sampler
    from irminsul.kernels import argmax

    calls = []
    real = argmax.argmax_rows
    monkeypatch.setattr(argmax, "argmax_rows", lambda x, **kw: calls.append(1) or real(x, **kw))
    rows = [torch.randn(777, generator=torch.Generator().manual_seed(i)).to(DEVICE)
            for i in range(4)]
    rows[1][300] = float("nan")
    rows[3].fill_(float("-inf"))
    got = sampler.greedy_tokens(rows).cpu()
    assert torch.equal(got[0], torch.stack(rows).argmax(-1).cpu())
    assert got[0, 1] == 300 and got[1].tolist() == [1, 0, 1, 0]
    assert len(calls) == (1 if DEVICE == "cuda" else 0)
