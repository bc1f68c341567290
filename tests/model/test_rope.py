"""The δ-rotation: re-rotating a cached k_r by δ equals computing it at p + δ, for every rotary."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from irminsul.model import parse_config
from irminsul.model.mla import MLAttention
from irminsul.model.rope import Rotary

SHAPE = dict(model_type="deepseek_v2", vocab_size=100, hidden_size=256, num_hidden_layers=1,
             num_attention_heads=2, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64,
             v_head_dim=16, intermediate_size=64, max_position_embeddings=163840)
YARN = dict(type="yarn", original_max_position_embeddings=4096, beta_fast=32, beta_slow=1)
ROTARIES = {  # rope settings of the real checkpoints (mla-models.md §7), plus layout variants
    "deepseek_v2_lite": dict(rope_theta=10000, rope_scaling=dict(YARN, factor=40, mscale=0.707,
                                                                 mscale_all_dim=0.707)),
    "deepseek_v3": dict(model_type="deepseek_v3", rope_theta=10000,
                        rope_scaling=dict(YARN, factor=40, mscale=1.0, mscale_all_dim=1.0)),
    "kimi_k2": dict(model_type="kimi_k2", rope_theta=50000,
                    rope_scaling=dict(YARN, factor=32, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                                      mscale_all_dim=1.0)),
    "moonlight": dict(model_type="deepseek_v3", rope_theta=50000, rope_scaling=None),
    "half_split": dict(model_type="deepseek_v3", rope_theta=10000, rope_scaling=None,
                       rope_interleave=False),
    "magnitude_not_one": dict(rope_theta=10000, rope_scaling=dict(YARN, factor=40, mscale=1.0,
                                                                  mscale_all_dim=0.707)),
}
DELTAS = [1, -1, 37, -250, 4096, -4097, 65536, -100_000, 100_000]


def _attention(name: str) -> MLAttention:
    """Layer-0 attention of a model with this rotary and the real 512 + 64 latent row."""
    config = parse_config({**SHAPE, **ROTARIES[name]})
    torch.manual_seed(0)
    attn = MLAttention(config, Rotary(config))
    nn.init.normal_(attn.kv_a_proj_with_mqa.weight, std=0.5)
    attn.requires_grad_(False)
    return attn


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", list(ROTARIES))
def test_rotation_equals_recomputation(name: str) -> None:
    attn = _attention(name)
    x = torch.randn(16, SHAPE["hidden_size"])
    rank = SHAPE["kv_lora_rank"]
    for delta in DELTAS:
        p = torch.arange(16) + 120_000 if delta < 0 else torch.arange(16) + 77
        k_at_p = attn.latent(x, p)[:, rank:]
        k_target = attn.latent(x, p + delta)[:, rank:]
        assert _rel_l2(attn.rotary.rotate(k_at_p, delta), k_target) <= 1e-6, (name, delta)
        # per-row deltas too (the engine rotates a whole chunk, or mixed rows, at once)
        per_row = torch.full((16,), delta)
        assert _rel_l2(attn.rotary.rotate(k_at_p, per_row), k_target) <= 1e-6


@pytest.mark.parametrize("name", list(ROTARIES))
def test_wrong_pair_layout_fails(name: str) -> None:
    attn = _attention(name)
    config = parse_config({**SHAPE, **ROTARIES[name]})
    wrong = Rotary(dataclasses.replace(config, rope_interleave=not config.rope_interleave))
    x, p, rank = torch.randn(16, SHAPE["hidden_size"]), torch.arange(16) + 500, SHAPE["kv_lora_rank"]
    k_at_p, k_target = attn.latent(x, p)[:, rank:], attn.latent(x, p + 37)[:, rank:]
    assert _rel_l2(wrong.rotate(k_at_p, 37), k_target) > 1e-2


def test_magnitude_scaled_rotation_fails() -> None:
    """YaRN's cos/sin magnitude is already inside k_r: scaling the re-rotation by it again is
    wrong (and the magnitude here really is not 1)."""
    attn = _attention("magnitude_not_one")
    magnitude = attn.rotary.magnitude
    assert abs(magnitude - 1.0) > 0.05
    x, p, rank = torch.randn(16, SHAPE["hidden_size"]), torch.arange(16) + 500, SHAPE["kv_lora_rank"]
    k_at_p, k_target = attn.latent(x, p)[:, rank:], attn.latent(x, p + 37)[:, rank:]
    assert _rel_l2(attn.rotary.rotate(k_at_p, 37), k_target) <= 1e-6
    assert _rel_l2(attn.rotary.rotate(k_at_p, 37) * magnitude, k_target) > 1e-2


def test_plain_rope_fallback_fails() -> None:
    """The paper's Appendix D pitfall: rotating with theta=10000 plain RoPE on a model with
    another theta (Moonlight, 5e4) gives a wrong key."""
    attn = _attention("moonlight")
    config = parse_config({**SHAPE, **ROTARIES["moonlight"]})
    fallback = Rotary(dataclasses.replace(config, rope=dataclasses.replace(config.rope,
                                                                           theta=10000.0)))
    x, p, rank = torch.randn(16, SHAPE["hidden_size"]), torch.arange(16) + 500, SHAPE["kv_lora_rank"]
    k_at_p, k_target = attn.latent(x, p)[:, rank:], attn.latent(x, p + 300)[:, rank:]
    assert _rel_l2(fallback.rotate(k_at_p, 300), k_target) > 1e-2
