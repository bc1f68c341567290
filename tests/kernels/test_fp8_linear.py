"""The weight-only FP8 linear (irminsul/kernels/fp8.py) against F.linear over naively dequantized
weights, whole and split along K, the launch's choice of split, and FP8Linear's switch to it. Runs
on CUDA, or on a CPU under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from test_fused_moe import DEVICE, check, dequantize_naive, quantize_blocks

from irminsul.device import SMS, sm_count
from irminsul.model.model import use_kernels

pytestmark = pytest.mark.triton


LINEAR_CASES = {  # tokens, out, in, block, tiles (None: the table's)
    "decode_v3_blocks": (1, 256, 384, (128, 128), None),  # a scale per column per K step
    "partial_blocks": (19, 72, 40, (16, 16), (16, 32, 32, 4, 2)),  # 2-D gather, masked edges
    "oblong": (33, 48, 64, (32, 16), (32, 16, 16, 4, 2)),
}


def reference(tokens: int, out: int, inp: int, block: tuple[int, int], dtype: torch.dtype,
              bias: bool, seed: int = 11) -> tuple[torch.Tensor, ...]:
    """x, float8 weight, scales, bias (or None) and the float64 product over the naively
    dequantized weight rounded to ``dtype`` (F.linear's view of the dequantize-at-load path)."""
    gen = torch.Generator().manual_seed(seed)
    q, s = quantize_blocks(torch.randn(out, inp, generator=gen) / inp ** 0.5, block)
    x = torch.randn(tokens, inp, generator=gen).to(dtype)
    b = torch.randn(out, generator=gen).to(dtype) if bias else None
    dense = dequantize_naive(q, s, block)
    want = x.double() @ dense.to(dtype).double().T + (b.double() if bias else 0.0)
    return x, q, s, b, want.float()


@pytest.mark.parametrize("case", list(LINEAR_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_f_linear_on_dequantized_weight(case: str, dtype: torch.dtype,
                                                           bias: bool) -> None:
    from irminsul.kernels.fp8 import fp8_linear

    tokens, out, inp, block, tiles = LINEAR_CASES[case]
    x, q, s, b, want = reference(tokens, out, inp, block, dtype, bias, seed=7)
    got = fp8_linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), block,
                     None if b is None else b.to(DEVICE), tiles=tiles)
    check(got, want, dtype)


SPLIT_CASES = {  # tokens, out, in, block, tiles, split_k asked, splits launched
    # two whole 128 × 128 scale blocks a split, one scale per column per K step
    "v3_blocks": (1, 256, 768, (128, 128), (16, 64, 128, 4, 2), 3, 3),
    # 2-D scale gather, masked rows, columns and K: 200 = 96 + 96 + 8 (the last split short)
    "partial_blocks": (19, 72, 200, (16, 16), (16, 32, 32, 4, 2), 3, 3),
    # blocks taller than wide; 4 asked of 10 K steps: 3 + 3 + 3 + 1
    "oblong": (5, 48, 160, (32, 16), (16, 16, 16, 4, 2), 4, 4),
    # K steps of 32 over 16-wide scale blocks: splits cut at multiples of 32, so 4 asked of
    # 6 steps give 3 of 64 (whole steps: no split reads into the next one's columns)
    "wide_steps": (7, 40, 192, (16, 16), (16, 16, 32, 4, 2), 4, 3),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("at_once", [True, False], ids=["sum_at_once", "sum_in_turn"])
def test_split_k_matches_f_linear_on_dequantized_weight(case: str, dtype: torch.dtype,
                                                        bias: bool, at_once: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Split along K, the partials summed in a second kernel (every split in one load, as for a
    decode step's few outputs, or one split at a time, as for many): the same product, the bias
    once."""
    from irminsul.kernels import fp8
    from irminsul.kernels.fp8 import fp8_linear, k_split

    if not at_once:
        monkeypatch.setattr(fp8, "SUM_AT_ONCE", 0)
    tokens, out, inp, block, tiles, asked, launched = SPLIT_CASES[case]
    assert k_split(tokens, out, inp, tiles, block[1], 132, asked).splits == launched
    x, q, s, b, want = reference(tokens, out, inp, block, dtype, bias)
    got = fp8_linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), block,
                     None if b is None else b.to(DEVICE), tiles=tiles, split_k=asked)
    check(got, want, dtype)


def test_k_split_fills_the_machine_for_decode_and_leaves_prefill_whole() -> None:
    """One token through q_a_proj (1536 × 7168, 24 tiles of 64 columns for 132 SMs) splits into
    whole scale blocks, at least MIN_SPLIT_DEPTH each, to 2-4 waves of programs; enough rows
    fill the machine without a split, as does a decode step whose K is short."""
    from irminsul.kernels import fp8

    sms = sm_count("cpu")
    assert sms == SMS == 132
    tiles = fp8.linear_tiles(1, torch.bfloat16)
    split = fp8.k_split(1, 1536, 7168, tiles, 128, sms)
    programs = -(-1536 // tiles[1]) * split.splits
    assert split.splits > 1 and split.depth % 128 == 0
    assert split.depth >= fp8.MIN_SPLIT_DEPTH * 128 and (split.splits - 1) * split.depth < 7168
    assert 2 * sms <= programs <= 4 * sms, programs
    assert fp8.k_split(1, 576, 7168, tiles, 128, sms).splits > 1  # kv_a_proj: 9 tiles
    assert fp8.k_split(1, 3072, 1536, tiles, 128, sms).splits == 1  # 12 scale blocks of K
    big = fp8.linear_tiles(4096, torch.bfloat16)
    assert fp8.k_split(4096, 1536, 7168, big, 128, sms).splits == 1  # 32 × 12 tiles
    assert fp8.k_split(1, 1536, 7168, tiles, 128, sms, 1).splits == 1  # asked: no split


def test_default_decode_launch_splits_and_sums_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_linear's own choice for one token over a long K: split (here 2 × 192 columns), the
    partials summed by one launch of the second kernel, with the bias; and a forced split_k=1
    writes y directly."""
    from irminsul.kernels import fp8

    block = (16, 16)
    x, q, s, b, want = reference(1, 40, 384, block, torch.float32, True)
    sums = []
    real = fp8._sum_splits
    monkeypatch.setattr(fp8, "_sum_splits",
                        lambda p, bias, y: sums.append(p.shape) or real(p, bias, y))
    got = fp8.fp8_linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), block, b.to(DEVICE))
    check(got, want, torch.float32)
    splits = fp8.k_split(1, 40, 384, fp8.linear_tiles(1, torch.float32), block[1],
                         sm_count(DEVICE)).splits
    assert splits > 1 and sums == [(splits, 1, 40)]
    got = fp8.fp8_linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), block, b.to(DEVICE),
                         split_k=1)
    check(got, want, torch.float32)
    assert len(sums) == 1
    with pytest.raises(ValueError, match="split_k"):
        fp8.fp8_linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), block, split_k=0)


def test_fp8_linear_module_runs_the_kernel_with_kernels_on() -> None:
    """FP8Linear: kernels on, the forward is the kernel (3-D input included) and gives the
    torch path's output; kernels off, the torch path."""
    from irminsul.kernels import fp8 as fp8_kernels
    from irminsul.model.fp8 import FP8Linear

    layer = FP8Linear(40, 24, bias=True, block=(16, 16))
    q, s = quantize_blocks(torch.randn(24, 40) * 0.2, (16, 16))
    layer.load_state_dict({"weight": q, "weight_scale_inv": s, "bias": torch.randn(24)})
    layer = layer.to(DEVICE)
    x = torch.randn(2, 3, 40).to(DEVICE)
    want = layer(x)
    use_kernels(layer, True)
    calls = []
    real = fp8_kernels.fp8_linear
    fp8_kernels.fp8_linear = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        got = layer(x)
    finally:
        fp8_kernels.fp8_linear = real
    assert calls and got.shape == (2, 3, 24)
    check(got, want.float().cpu(), torch.float32)
