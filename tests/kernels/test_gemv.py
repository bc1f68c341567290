"""The decode projections' GEMV (irminsul.kernels.gemv) against float64 matmuls, its tile rule
against hand-worked V2-Lite and V3 shapes, and its refusals.

Runs on CUDA, or on a CPU under Triton's interpreter (tests/conftest.py switches it on without
CUDA)."""

from __future__ import annotations

import pytest
import torch

from irminsul.kernels import gemv as gemv_module
from irminsul.kernels.gemv import fits, gemv, normed_gemv, tiles

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def switched_on(monkeypatch) -> None:
    """The GEMV takes up to 16 rows here, whatever the engine's default."""
    monkeypatch.setattr(gemv_module, "MAX_TOKENS", 16)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x · wᵀ in float64 (batched when 3-D)."""
    return x.double() @ w.double().transpose(-1, -2)


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    # float32 sums in another order; bf16: one rounding of the output (8 bits of mantissa).
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.double(), want.to(got.device), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_linear_shape_matches_float64(dtype: torch.dtype, rows: int) -> None:
    """[T, K] · [N, K]ᵀ with N no multiple of any tile (the last program's columns masked)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=g).to(DEVICE, dtype)
    w = torch.randn(200, 256, generator=g).to(DEVICE, dtype)
    check(gemv(x, w), reference(x, w), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("release", [False, True])
def test_batched_strided_views_match_bmm(dtype: torch.dtype, release: bool) -> None:
    """W_UV's use: a head-major view of the attention output [T, H, R] times w_uv [H, V, R],
    written into a transposed view of [T, H, V] (the o_proj's input), rows outside untouched."""
    g = torch.Generator().manual_seed(7)
    tokens, heads, rank, v = 5, 4, 128, 24
    latent = torch.randn(tokens, heads, rank, generator=g).to(DEVICE, dtype)
    w_uv = torch.randn(heads, v, rank, generator=g).to(DEVICE, dtype)
    out = torch.full((tokens + 1, heads, v), 7.0, device=DEVICE, dtype=dtype)
    gemv(latent.transpose(0, 1), w_uv, out=out[:tokens].transpose(0, 1), release=release)
    want = reference(latent.transpose(0, 1), w_uv).transpose(0, 1)
    check(out[:tokens], want, dtype)
    assert bool((out[tokens] == 7.0).all())


def test_transposed_weight_reads_by_strides() -> None:
    """A weight stored [K, N] and passed transposed (W_UK's layout) needs no copy."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 64, generator=g).to(DEVICE)
    w = torch.randn(2, 64, 40, generator=g).to(DEVICE)  # [B, K, N]
    check(gemv(x, w.transpose(1, 2)), reference(x, w.transpose(1, 2)), torch.float32)


def test_preload_switch_gives_the_same_result(monkeypatch) -> None:
    """Loading the weight before or after the wait changes nothing but timing."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 128, generator=g).to(DEVICE)
    w = torch.randn(96, 128, generator=g).to(DEVICE)
    first = gemv(x, w)
    monkeypatch.setattr(gemv_module, "PRELOAD", False)
    assert torch.equal(gemv(x, w), first)


def test_tiles_of_real_shapes() -> None:
    """Worked by hand for 132 SMs and bf16: V2-Lite's joint projection (3,648 × 2,048) and
    o_proj (2,048 × 2,048) take 16 columns (64 KB a program, 8 warps: 228 and 128 programs);
    W_UV (16 heads of 128 × 512) 16 columns (16 KB, 4 warps: 128 programs); a small weight
    keeps 64 columns when that already gives every SM a program; DeepSeek-V3's 7,168-wide K
    does not fit (16 rows would be 224 KB), nor does a K that is no power of two."""
    if DEVICE == "cuda" and torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("worked for 132 SMs")
    bf16, at = torch.bfloat16, torch.device(DEVICE)
    assert tiles(3648, 2048, 1, bf16, at) == (16, 8)
    assert tiles(2048, 2048, 1, bf16, at) == (16, 8)
    assert tiles(128, 512, 16, bf16, at) == (16, 4)
    assert tiles(512 * 132, 128, 1, bf16, at) == (64, 4)  # 64 × 128 × 2 = 16 KB, 1,056 programs
    assert tiles(2112, 7168, 1, bf16, at) is None
    assert tiles(2048, 1536, 1, bf16, at) is None
    assert tiles(2048, 4096, 1, torch.float32, at) is None  # 16 × 4096 × 4 = 256 KB


def test_refusals_name_what_is_wrong(monkeypatch) -> None:
    x = torch.zeros(17, 64, device=DEVICE)
    w = torch.zeros(32, 64, device=DEVICE)
    assert not fits(x, w)
    with pytest.raises(ValueError, match="rows"):
        gemv(x, w)
    with pytest.raises(ValueError, match="must match"):
        gemv(x[:2], torch.zeros(32, 48, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        gemv(x[:2], w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out is"):
        gemv(x[:2], w, out=torch.zeros(2, 31, device=DEVICE))
    monkeypatch.setattr(gemv_module, "MAX_TOKENS", 0)  # the switch turns it off
    assert not fits(x[:1], w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, terms", [(1, 0), (1, 8), (3, 3)])
def test_normed_gemv_matches_torch_add_norm_then_float64(dtype: torch.dtype, rows: int,
                                                         terms: int) -> None:
    """normed_gemv against torch: summed = residual + delta (a MoE's terms summed first, in
    order, 0: a plain [T, K] delta), then F.rms_norm of it times w in float64; the sum written
    once."""
    g = torch.Generator().manual_seed(10 * rows + terms)
    k, n, eps = 256, 200, 1e-6
    residual = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    delta = torch.randn(*((rows, terms, k) if terms else (rows, k)), generator=g).to(DEVICE,
                                                                                      dtype)
    weight = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE)  # float32, as a checkpoint's
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    y, summed = normed_gemv(residual, delta, weight, eps, w)
    # The terms summed one after another in float32, rounded once: torch's own sum of a float32
    # tensor takes another order on a GPU, which float32 shows (bfloat16's rounding hides it).
    terms_sum = torch.zeros(rows, k, device=DEVICE)
    for j in range(terms):
        terms_sum += delta[:, j].float()
    want_summed = residual + (terms_sum.to(dtype) if terms else delta)
    torch.testing.assert_close(summed, want_summed, rtol=0, atol=0)
    normed = torch.nn.functional.rms_norm(want_summed, (k,), weight.to(dtype), eps)
    check(y, reference(normed, w), dtype)
    out = torch.zeros_like(summed)  # or into a buffer the caller holds
    normed_gemv(residual, delta, weight, eps, w, out)
    assert torch.equal(out, summed)


def test_normed_gemv_refusals_name_what_is_wrong() -> None:
    residual, w = torch.zeros(1, 64, device=DEVICE), torch.zeros(32, 64, device=DEVICE)
    weight = torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        normed_gemv(residual, torch.zeros(1, 48, device=DEVICE), weight, 1e-6, w)
    with pytest.raises(ValueError, match="norm weight"):
        normed_gemv(residual, residual, torch.ones(48, device=DEVICE), 1e-6, w)
    with pytest.raises(ValueError, match="summed is"):
        normed_gemv(residual, residual, weight, 1e-6, w, torch.zeros(2, 64, device=DEVICE))
    with pytest.raises(ValueError, match="not a GEMV shape"):
        normed_gemv(torch.zeros(17, 64, device=DEVICE), torch.zeros(17, 64, device=DEVICE),
                    weight, 1e-6, w)


def test_engine_decode_through_the_gemv_equals_cublas_path(tmp_path, monkeypatch) -> None:
    """The attention's projections at decode (joint, W_UV, o_proj) through the GEMV give the
    logits of the path without it, with the add + norm before the joint projection folded into
    its launch (from the second layer on) or not; the GEMV ran three times a layer per decode
    step."""
    import numpy as np
    from fixtures.tiny_models import build

    from irminsul.config import EngineConfig
    from irminsul.engine import Engine
    from irminsul.model import load_model

    build("v2_lite_like", tmp_path, layers=2)
    model = load_model(tmp_path, device=DEVICE)
    prompt = np.arange(3, 43) % model.config.vocab_size
    calls = {"gemv": 0, "normed_gemv": 0}
    for name in calls:
        real = getattr(gemv_module, name)
        monkeypatch.setattr(gemv_module, name,
                            lambda *a, _real=real, _name=name, **k: calls.__setitem__(
                                _name, calls[_name] + 1) or _real(*a, **k))
    logits, counts = {}, {}
    for limit, folds in ((0, True), (16, False), (16, True)):
        monkeypatch.setattr(gemv_module, "MAX_TOKENS", limit)
        monkeypatch.setattr(gemv_module, "FOLDS_NORM", folds)
        engine = Engine(model, EngineConfig(slots=200, mode="off", kernels=True))
        seq, first = engine.prefill(prompt)
        steps = [first] + [engine.extend(seq, [token])[-1] for token in (5, 9, 2)]
        engine.finish(seq, remember=False)
        engine.check()
        logits[limit, folds] = torch.stack(steps)
        counts[limit, folds] = dict(calls)
        calls.update(gemv=0, normed_gemv=0)
    # Three projections, two layers, three steps; folded, the second layer's joint one norms.
    assert counts[16, False] == {"gemv": 3 * 2 * 3, "normed_gemv": 0}
    assert counts[16, True] == {"gemv": 5 * 3, "normed_gemv": 3}
    assert counts[0, True] == {"gemv": 0, "normed_gemv": 0}
    torch.testing.assert_close(logits[16, False], logits[0, True], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[16, True], logits[0, True], rtol=1e-4, atol=1e-4)
