"""MLAttention.join_projections: the two projections of x stored as one weight, each module's
weight a view of its rows — the checkpoint's tensors unchanged, the memory not doubled, and the
join dropped (two GEMMs again) when a weight is replaced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from irminsul.model import parse_config
from irminsul.model.fp8 import FP8Linear
from irminsul.model.mla import MLAttention
from irminsul.model.rope import Rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel: CUDA, or the interpreter

FIELDS = dict(model_type="deepseek_v2", vocab_size=64, hidden_size=32, num_hidden_layers=1,
              num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=8, intermediate_size=32, max_position_embeddings=512, rope_theta=1e4)


def attention(**overrides) -> MLAttention:
    config = parse_config({**FIELDS, **overrides})
    torch.manual_seed(0)
    module = MLAttention(config, Rotary(config))
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return module.requires_grad_(False)


def test_join_keeps_the_checkpoint_tensors_as_views_of_one_weight() -> None:
    for overrides in ({}, {"q_lora_rank": 24}):  # q_proj; q_a_proj with a q LoRA
        module = attention(**overrides)
        before = {k: v.clone() for k, v in module.state_dict().items()}
        module.join_projections()
        after = module.state_dict()
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)
        joints = module._joined()
        first = module._first()
        assert joints is not None and list(joints) == ["weight"]
        joint = joints["weight"]
        assert joint.shape[0] == first.out_features + 16 + 8
        assert first.weight.data_ptr() == joint.data_ptr()  # views, not copies
        assert module.kv_a_proj_with_mqa.weight.data_ptr() == joint[first.out_features:].data_ptr()
        x = torch.randn(3, 32)
        both = F.linear(x, joint)
        torch.testing.assert_close(both[:, :first.out_features], first(x))
        torch.testing.assert_close(both[:, first.out_features:], module.kv_a_proj_with_mqa(x))
        # Loading into the views writes the joint weight too.
        module.load_state_dict({k: v + 1 for k, v in before.items()})
        assert module._joined() is not None
        torch.testing.assert_close(F.linear(x, joint)[:, :first.out_features], first(x))


def test_a_replaced_weight_ends_the_join() -> None:
    module = attention()
    module.join_projections()
    module.kv_a_proj_with_mqa.weight = torch.nn.Parameter(torch.zeros(24, 32))
    assert module._joined() is None


def fp8_pair(module: MLAttention, q_rows: int, block: tuple[int, int]) -> None:
    """Give ``module`` FP8 q_a / kv_a projections with random float8 weights and scales."""
    gen = torch.Generator().manual_seed(q_rows)
    for name, rows in (("q_a_proj", q_rows), ("kv_a_proj_with_mqa", 24)):
        layer = FP8Linear(32, rows, bias=False, block=block)
        layer.weight.copy_((torch.randn(rows, 32, generator=gen) * 20).to(torch.float8_e4m3fn))
        layer.weight_scale_inv.copy_(torch.rand(layer.weight_scale_inv.shape, generator=gen) + 0.01)
        setattr(module, name, layer)


@pytest.mark.triton
def test_fp8_projections_join_on_a_scale_block() -> None:
    """q_a_proj of 32 rows in 16-row blocks: weights and scale grids joined; the joint FP8 GEMM
    gives each projection's own output (the kernel, as with kernels on)."""
    module = attention(q_lora_rank=32)
    fp8_pair(module, 32, (16, 16))
    module.to(DEVICE)
    module.q_a_proj.kernels = module.kv_a_proj_with_mqa.kernels = True
    module.join_projections()
    joints = module._joined()
    assert joints is not None and set(joints) == {"weight", "weight_scale_inv"}
    assert joints["weight"].shape == (56, 32) and joints["weight_scale_inv"].shape == (4, 2)
    assert module.q_a_proj.weight_scale_inv.data_ptr() == joints["weight_scale_inv"].data_ptr()
    x = torch.randn(3, 32, device=DEVICE)
    both = module._joint_projection(x, joints)
    torch.testing.assert_close(both, torch.cat([module.q_a_proj(x),
                                                module.kv_a_proj_with_mqa(x)], 1))


def test_biased_and_unaligned_projections_stay_apart() -> None:
    biased = attention(attention_bias=True)
    biased.join_projections()
    assert biased._joined() is None
    module = attention(q_lora_rank=24)
    fp8_pair(module, 24, (16, 16))  # 24 rows: kv_a's rows would start inside a scale block
    module.join_projections()
    assert module._joined() is None
