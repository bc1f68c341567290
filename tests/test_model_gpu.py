"""The runtime on CUDA: same logits as transformers on CPU (fp32), bf16 close, both MLA forms."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build

from irminsul.model import load_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", ["v2_lite_like", "v3_like"])
def test_cuda_matches_transformers(case: str, tmp_path) -> None:
    reference = build(case, tmp_path)
    ids = torch.randint(0, 97, (64,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    model = load_model(tmp_path, device="cuda")
    got = model.logits(ids.cuda()).cpu()
    assert (got - expected).abs().max() <= 1e-3  # TF32-free fp32 on GPU: small reduction-order noise
    absorbed = model.forward(ids.cuda(), torch.arange(64).cuda(), absorbed=True).logits.cpu()
    assert (absorbed - got).abs().max() <= 1e-3
    half = load_model(tmp_path, device="cuda", dtype=torch.bfloat16)
    low = half.logits(ids.cuda()).cpu()
    assert (low - expected).abs().max() / expected.abs().max() <= 0.1
    assert (low.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8
