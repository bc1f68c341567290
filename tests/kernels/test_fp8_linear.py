"""The weight-only FP8 linear (irminsul/kernels/fp8.py) against F.linear over naively dequantized
weights, and FP8Linear's switch to it. Runs on CUDA, or on a CPU under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from test_fused_moe import DEVICE, check, dequantize_naive, quantize_blocks

from irminsul.model.model import use_kernels

pytestmark = pytest.mark.triton


LINEAR_CASES = {  # tokens, out, in, block, tiles (None: the table's)
    "decode_v3_blocks": (1, 256, 384, (128, 128), None),  # a scale per column per K step
    "partial_blocks": (19, 72, 40, (16, 16), (16, 32, 32, 4, 2)),  # 2-D gather, masked edges
    "oblong": (33, 48, 64, (32, 16), (32, 16, 16, 4, 2)),
}


@pytest.mark.parametrize("case", list(LINEAR_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_f_linear_on_dequantized_weight(case: str, dtype: torch.dtype,
                                                           bias: bool) -> None:
    from irminsul.kernels.fp8 import fp8_linear

    tokens, out, inp, block, tiles = LINEAR_CASES[case]
    gen = torch.Generator().manual_seed(7)
    q, s = quantize_blocks(torch.randn(out, inp, generator=gen) / inp ** 0.5, block)
    x = torch.randn(tokens, inp, generator=gen).to(dtype)
    b = torch.randn(out, generator=gen).to(dtype) if bias else None
    dense = dequantize_naive(q, s, block)
    want = x.double() @ dense.to(dtype).double().T + (b.double() if bias else 0.0)
    got = fp8_linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), block,
                     None if b is None else b.to(DEVICE), tiles=tiles)
    check(got, want.float(), dtype)


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
