"""FP8 weights kept in memory: :class:`FP8Linear` and ``load_model(..., keep_fp8=True)``.

The checkpoint is test_model_loader's tiny FP8 V3 (16x16 blocks, dims mostly not multiples of 16,
so partial edge blocks everywhere). The kept model must hold its float8 linears as float8 and give
the dequantize-at-load model's logits exactly: both dequantize with the same float32 arithmetic
(fp8.dequantize_blocks) and round once into the model dtype, so every F.linear sees bit-identical
weights and inputs.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

pytest.importorskip("transformers")  # the FP8 fixture is built from a transformers model

# tests/model is on sys.path under pytest (rootdir-relative imports of test modules)
from test_model_loader import (  # noqa: E402
    FP8_BLOCK,
    IDS,
    config_of,
    fp8,
    naive_dequant,
    quantize,
    write_checkpoint,
)

from irminsul.model import CheckpointError, load_model  # noqa: E402
from irminsul.model.config import QuantConfig  # noqa: E402
from irminsul.model.fp8 import FP8Linear  # noqa: E402
from irminsul.model.loader import dequantize_weight  # noqa: E402

__all__ = ["fp8"]  # the imported module-scoped fixture, used below

# The linear the loader still dequantizes with keep_fp8 (read as a dense matrix outside its
# forward: the absorbed attention splits it); the routed experts are kept, stacked by MoE.fuse.
DENSE_ONLY = (".self_attn.kv_b_proj.",)
EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def kept_names(fp8) -> set[str]:
    """The checkpoint's float8 weights kept as FP8Linear weights (routed experts excluded)."""
    return {n for n in fp8.quantized
            if not any(part in n for part in DENSE_ONLY) and not EXPERT.match(n)}


def kept_experts(fp8) -> dict[str, list[str]]:
    """MoE layer prefix → the checkpoint's float8 expert weights it stacks."""
    layers: dict[str, list[str]] = {}
    for name in fp8.quantized:
        match = EXPERT.match(name)
        if match:
            layers.setdefault(match.group(1), []).append(name)
    return layers


@pytest.fixture(scope="module")
def models(fp8):
    """{dtype: (dequantize-at-load model, keep_fp8 model)} for float32 and bfloat16."""
    return {dtype: (load_model(fp8.directory, dtype=dtype),
                    load_model(fp8.directory, dtype=dtype, keep_fp8=True))
            for dtype in (torch.float32, torch.bfloat16)}


def test_kept_weights_are_float8_in_memory(fp8, models):
    plain, kept = models[torch.bfloat16]
    params = dict(kept.named_parameters())
    experts = kept_experts(fp8)
    stacked = {f"{layer}.{w}" for layer in experts for w in ("w13", "w2")}
    float8 = {n for n, p in params.items() if p.dtype == torch.float8_e4m3fn} - stacked
    assert float8 == kept_names(fp8) and len(float8) > 10
    assert all(params[n].dtype == torch.float8_e4m3fn for n in stacked) and experts
    for name in float8:
        assert isinstance(kept.get_submodule(name.removesuffix(".weight")), FP8Linear)
        assert params[name + "_scale_inv"].dtype == torch.float32
        # the stored bytes are exactly the checkpoint's float8 tensor
        assert torch.equal(params[name].view(torch.uint8),
                           load_file(str(fp8.directory / "model.safetensors"))[name]
                           .view(torch.uint8))
    # Each expert's gate, up and down bytes, stacked as the checkpoint stores them.
    tensors = load_file(str(fp8.directory / "model.safetensors"))
    for layer in experts:
        moe = kept.get_submodule(layer)
        for e in range(moe.w13.shape[0]):
            gate, up, down = (tensors[f"{layer}.experts.{e}.{p}_proj.weight"]
                              for p in ("gate", "up", "down"))
            assert torch.equal(moe.w13[e].view(torch.uint8),
                               torch.cat([gate, up]).view(torch.uint8))
            assert torch.equal(moe.w2[e].view(torch.uint8), down.view(torch.uint8))
            gate_s, up_s, down_s = (tensors[f"{layer}.experts.{e}.{p}_proj.weight_scale_inv"]
                                    for p in ("gate", "up", "down"))
            assert torch.equal(moe.w13_scale_inv[e], torch.cat([gate_s, up_s]))
            assert torch.equal(moe.w2_scale_inv[e], down_s)
    plain_params = dict(plain.named_parameters())
    every = float8 | stacked
    fp8_bytes = sum(params[n].nbytes for n in every)
    bf16_bytes = sum(plain_params[n].nbytes for n in every)
    assert plain_params[next(iter(float8))].dtype == torch.bfloat16
    assert 2 * fp8_bytes == bf16_bytes
    scale_bytes = (sum(params[n + "_scale_inv"].nbytes for n in float8)
                   + sum(params[n + "_scale_inv"].nbytes for n in stacked))
    total_kept = sum(p.nbytes for p in kept.parameters())
    total_plain = sum(p.nbytes for p in plain.parameters())
    assert total_kept == total_plain - fp8_bytes + scale_bytes < total_plain
    # kv_b_proj stays dense in the model dtype
    assert kept.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kept_logits_equal_dequantized_at_load(models, dtype):
    plain, kept = models[dtype]
    ref = plain.logits(IDS)
    assert ref.abs().max() > 1.0
    assert torch.equal(kept.logits(IDS), ref)
    # a decode step after a cached context: the absorbed attention reads kv_b_proj.weight directly
    split = 9
    ctx = plain.forward(IDS[:split], torch.arange(split)).latents
    step = dict(token_ids=IDS[split:], positions=torch.arange(split, len(IDS)), absorbed=True)
    assert torch.equal(kept.forward(context=ctx, **step).logits,
                       plain.forward(context=ctx, **step).logits)


def test_keep_fp8_on_a_plain_checkpoint_changes_nothing(fp8):
    plain = load_model(fp8.deq_dir)
    kept = load_model(fp8.deq_dir, keep_fp8=True)
    assert not any(isinstance(m, FP8Linear) for m in kept.modules())
    assert torch.equal(kept.logits(IDS), plain.logits(IDS))


@pytest.mark.parametrize("block", [(128, 128), (128, 64)], ids=["128x128", "128x64"])
def test_fp8_linear_equals_f_linear_on_dequantized_weight(block):
    """Ragged shapes (200 x 300: partial edge blocks both ways); non-square blocks catch a swap
    of the row and column block sizes."""
    torch.manual_seed(0)
    out_features, in_features = 200, 300
    q, s = quantize(torch.randn(out_features, in_features) * 0.3, *block)
    layer = FP8Linear(in_features, out_features, block=block)
    layer.load_state_dict({"weight": q, "weight_scale_inv": s})
    w = dequantize_weight(q, s, QuantConfig(block=block))
    # the shared helper itself against an element-by-element dequantization
    assert torch.equal(w, naive_dequant(q, s, *block))
    x = torch.randn(5, in_features)
    assert torch.equal(layer(x), F.linear(x, w))
    xb = x.bfloat16()
    assert layer(xb).dtype == torch.bfloat16
    assert torch.equal(layer(xb), F.linear(xb, w.bfloat16()))


def test_fp8_linear_refuses_scales_that_do_not_fit_the_weight():
    """E.g. a weight sliced for tensor parallel without its scales: an error, not wrong blocks."""
    layer = FP8Linear(40, 50, block=(16, 16))
    layer.weight = torch.nn.Parameter(layer.weight.data[:20], requires_grad=False)
    with pytest.raises(ValueError, match=r"weight_scale_inv \(4, 3\) does not fit weight \(20, 40\)"):
        layer(torch.randn(2, 40))


def test_kept_weight_with_bad_scale_shape_is_refused(fp8, tmp_path):
    tensors = load_file(str(fp8.directory / "model.safetensors"))
    name = "model.layers.1.self_attn.q_a_proj.weight"
    assert name in kept_names(fp8)
    tensors[name + "_scale_inv"] = tensors[name + "_scale_inv"][:-1]
    broken = write_checkpoint(tmp_path / "bad", tensors, config_of(fp8.directory))
    rows = -(-tensors[name].shape[0] // FP8_BLOCK)
    with pytest.raises(CheckpointError, match=rf"{name}_scale_inv has shape \({rows - 1}, .*"
                                              rf"needs \({rows}, "):
        load_model(broken, keep_fp8=True)
