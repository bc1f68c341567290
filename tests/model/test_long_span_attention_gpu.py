"""A long chunk after its context on CUDA (bf16): flash attention with zero-padded values under
the lower-right causal mask, against attention written out by hand in float32."""

from __future__ import annotations

import pytest
import torch

from irminsul.model import parse_config
from irminsul.model.mla import MLAttention
from irminsul.model.rope import Rotary

pytestmark = pytest.mark.gpu

# DeepSeek-V2-Lite's attention widths (nope 128 + rope 64 keys, values 128, rank 512), few heads.
FIELDS = dict(model_type="deepseek_v2", vocab_size=64, hidden_size=256, num_hidden_layers=1,
              num_attention_heads=4, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
              v_head_dim=128, intermediate_size=64, max_position_embeddings=4096,
              rope_theta=1e4)


def _by_hand(attn: MLAttention, q_nope, q_rope, rows, context) -> torch.Tensor:
    """[T, H, V]: softmax(q·k / √d) v with token i seeing the context and new rows 0..i."""
    keys = torch.cat([context, rows])
    k, v = attn._per_head(keys)  # [H, L, 192], [H, L, 128]
    q = torch.cat([q_nope, q_rope], -1).transpose(0, 1)  # [H, T, 192]
    scores = q @ k.transpose(1, 2) * attn.scale
    n_new, n_ctx = rows.shape[0], context.shape[0]
    seen = torch.arange(keys.shape[0], device=keys.device)[None] <= (
        n_ctx + torch.arange(n_new, device=keys.device))[:, None]
    scores = scores.masked_fill(~seen, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunk_after_its_context_runs_flash_and_matches_by_hand() -> None:
    config = parse_config(FIELDS)
    torch.manual_seed(0)
    attn = MLAttention(config, Rotary(config)).requires_grad_(False)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.05)
    attn = attn.cuda()
    n_ctx, n_new, heads = 700, 300, 4  # a chunk past naive_from (171), its context longer
    assert n_new >= attn.naive_from
    gen = torch.Generator(device="cuda").manual_seed(1)
    q_nope = torch.randn(n_new, heads, 128, device="cuda", generator=gen)
    q_rope = torch.randn(n_new, heads, 64, device="cuda", generator=gen)
    rows = torch.randn(n_new, 576, device="cuda", generator=gen)
    context = torch.randn(n_ctx, 576, device="cuda", generator=gen)
    expected = _by_hand(attn, q_nope, q_rope, rows, context)

    half = attn.to(torch.bfloat16)
    args = [t.to(torch.bfloat16) for t in (q_nope, q_rope, rows, context)]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = half._attend(*args, absorbed=None)
        torch.cuda.synchronize()
    assert got.shape == (n_new, heads, 128)
    kernels = " ".join(e.key for e in prof.key_averages()).lower()
    assert "flash" in kernels, kernels[:500]
    error = (got.float() - expected).abs().max() / expected.abs().max()
    assert error <= 2e-2, error
