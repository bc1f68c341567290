"""The decode-size GEMV (irminsul.kernels.gemv) against float64 products computed by torch.

bf16 results must lie within one bf16 ulp of the float64 product (the kernel accumulates in
float32 and rounds once); float32 results within float32 summation-order noise. The layouts the
decode step hands it — a head-major view of the query, a transposed weight, an output written
into columns of a wider buffer — are taken as they are, and nothing outside ``out`` is touched.
Runs on CUDA, or on a CPU under Triton's interpreter (tests/conftest.py switches it on).
"""

from __future__ import annotations

import pytest
import torch

from irminsul.kernels.gemv import MAX_ROWS, GemvTiles, gemv

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _within_one_ulp(got: torch.Tensor, want64: torch.Tensor) -> None:
    """Every bf16 value of ``got`` within one bf16 ulp of the float64 reference."""
    want = want64.to(torch.bfloat16).double()
    ulp = torch.where(want == 0, torch.full_like(want, 2.0 ** -133),
                      2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-38))) - 7))
    err = (got.double() - want64).abs()
    assert bool((err <= ulp).all()), f"worst {float((err / ulp).max()):.2f} ulp"


@pytest.mark.parametrize("rows, n, k", [(1, 64, 512), (5, 50, 200), (16, 33, 48),
                                        (3, 130, 1000)])
def test_linear_rows_within_one_ulp(rows: int, n: int, k: int) -> None:
    """x [T, K] · w[N, K]ᵀ: columns not a multiple of a program's 16, reductions not a
    multiple of its step (masked tail), one to sixteen rows."""
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    got = gemv(x.to(DEVICE), w.to(DEVICE)).cpu()
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    _within_one_ulp(got, x.double() @ w.double().T)


def test_float32_matches_torch() -> None:
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(4, 300, generator=g), torch.randn(70, 300, generator=g)
    got = gemv(x.to(DEVICE), w.to(DEVICE)).cpu()
    torch.testing.assert_close(got, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-4)


def test_batched_strided_views_as_the_decode_step_passes_them() -> None:
    """W_UK's product as MLAttention's fused path runs it: q_nope a head-major view of
    [T, H, nope + rope], the weight [H, nope, rank] transposed, the result written into the
    first rank columns of the attention query [T, H, rank + rope] — whose rope columns stay."""
    tokens, heads, nope, rope, rank = 3, 5, 32, 16, 48
    g = torch.Generator().manual_seed(3)
    q = torch.randn(tokens, heads, nope + rope, generator=g).to(torch.bfloat16)
    w_uk = (torch.randn(heads, nope, rank, generator=g) / nope ** 0.5).to(torch.bfloat16)
    query = torch.randn(tokens, heads, rank + rope, generator=g).to(torch.bfloat16)
    q_d, w_d, query_d = q.to(DEVICE), w_uk.to(DEVICE), query.to(DEVICE)
    out = query_d[..., :rank].transpose(0, 1)
    returned = gemv(q_d[..., :nope].transpose(0, 1), w_d.transpose(1, 2), out=out)
    assert returned.data_ptr() == out.data_ptr()
    got = query_d.cpu()
    want = torch.einsum("thn,hnr->thr", q[..., :nope].double(), w_uk.double())
    _within_one_ulp(got[..., :rank], want)
    assert torch.equal(got[..., rank:], query[..., rank:])  # untouched


def test_batched_matches_bmm_and_any_tiles_agree() -> None:
    """[B, T, K] · [B, N, K]ᵀ is torch.bmm(x, w.transpose(1, 2)); a launch shape other than
    the default computes the same values (the sum's order within a program may differ)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 2, 96, generator=g)
    w = torch.randn(4, 40, 96, generator=g)
    want = torch.bmm(x.double(), w.double().transpose(1, 2)).float()
    xd, wd = x.to(DEVICE), w.to(DEVICE)
    for tiles in (None, GemvTiles(16, 32, num_warps=2, num_stages=2), GemvTiles(32, 128)):
        torch.testing.assert_close(gemv(xd, wd, tiles=tiles).cpu(), want, rtol=1e-5, atol=1e-4)


def test_default_tiles_follow_the_program_count() -> None:
    """16 columns a program until that is more than four programs per SM; whole short K."""
    from irminsul.device import sm_count

    sms = sm_count(torch.device(DEVICE))
    assert GemvTiles.default(16 * sms, 512, 1, torch.device(DEVICE)) == GemvTiles(16, 256)
    many = GemvTiles.default(16 * 4 * sms + 16, 64, 1, torch.device(DEVICE))
    assert many == GemvTiles(32, 64)


def test_no_rows_gives_an_empty_result() -> None:
    x = torch.empty(0, 8, device=DEVICE)
    assert gemv(x, torch.ones(4, 8, device=DEVICE)).shape == (0, 4)


@pytest.mark.parametrize("x_shape, w_shape, fragment", [
    ((MAX_ROWS + 1, 8), (4, 8), "at most 16"),
    ((2, 8), (4, 9), "8 columns and w rows of 9"),
    ((8,), (4, 8), "want [T, K] and [N, K]"),
    ((2, 2, 8), (3, 4, 8), "want [T, K] and [N, K]"),
])
def test_bad_shapes_are_refused_with_what_was_wrong(x_shape: tuple, w_shape: tuple,
                                                    fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        gemv(torch.ones(x_shape, device=DEVICE), torch.ones(w_shape, device=DEVICE))


def test_mixed_dtypes_and_a_wrong_out_are_refused() -> None:
    x, w = torch.ones(2, 8, device=DEVICE), torch.ones(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="one floating dtype"):
        gemv(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"out is \(2, 5\)"):
        gemv(x, w, out=torch.empty(2, 5, device=DEVICE))
