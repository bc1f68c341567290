"""Tensor-parallel attention and expert-parallel MoE on 2 and 4 gloo ranks give the logits of one
process (1e-5, fp32), through the full forward and through the paged forward the engine drives,
for tiny DeepSeek-V2 and V3 models; every rank holds the same latent pool as one process. On a
host with two GPUs, the same over NCCL."""

from __future__ import annotations

import pytest
import torch
from parallel_ranks import run_ranks, values
from tiny_parallel import MODELS, TOKENS, paged_logits, tiny_model

from irminsul.model.moe import MoE, grouped_experts
from irminsul.parallel import ParallelGroup, shard_model, shard_weights


def compare(group: ParallelGroup, device: str = "cpu") -> dict:
    """Each case's largest differences from the unsharded model on this rank."""
    out = {}
    for name, (case, overrides) in MODELS.items():
        model = tiny_model(case, seed=1, **overrides).to(device)
        ids = torch.randint(0, 97, (TOKENS,), generator=torch.Generator().manual_seed(2)).to(device)
        full = model.logits(ids)
        paged, ckv, kr = paged_logits(model, ids, prefill=12, span=6)
        shard_model(model, group)
        tp_full = model.logits(ids)
        tp_paged, tp_ckv, tp_kr = paged_logits(model, ids, prefill=12, span=6)
        # The same shards without their all-reduce: the control that shows a wrong sum shows.
        reduce = [layer.reduce for layer in model.model.layers]
        for layer in model.model.layers:
            layer.reduce = None
        unsummed = model.logits(ids)
        for layer, r in zip(model.model.layers, reduce):
            layer.reduce = r
        out[name] = dict(
            full=float((tp_full - full).abs().max()),
            paged=float((tp_paged - paged).abs().max()),
            paged_vs_full=float((paged - full).abs().max()),
            pool=float(max((tp_ckv - ckv).abs().max(), (tp_kr - kr).abs().max())),
            unsummed=float((unsummed - full).abs().max()),
            spread=float(full.std()),
            heads=model.config.num_attention_heads,
            logits=tp_full.cpu())
    return out


@pytest.mark.parametrize("world, device", [(2, "cpu"), (4, "cpu"), pytest.param(2, "cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")])])
def test_sharded_ranks_match_one_process(world: int, device: str) -> None:
    """On CUDA, two GPUs over NCCL, each rank against one process on its GPU (the torch path in
    fp32, TF32 off); NCCL's all-reduce gives every rank the same sum, as gloo's does."""
    ranks = values(run_ranks(compare, world, device, timeout_s=300, device=device))
    for name in MODELS:
        for rank, result in enumerate(ranks):
            r = result[name]
            assert r["spread"] > 0.5, (name, r["spread"])  # 1e-5 is a meaningful bound
            assert r["paged_vs_full"] <= 1e-4, (name, rank, r)  # naive vs absorbed form
            assert r["full"] <= 1e-5, (name, rank, r)
            assert r["paged"] <= 1e-5, (name, rank, r)
            assert r["pool"] <= 1e-5, (name, rank, r)
            assert r["unsummed"] > 1e-2, (name, rank, r)
            assert r["heads"] == 4 // world
        # The all-reduce gives every rank the same bits: the replicated state cannot drift.
        for result in ranks[1:]:
            assert torch.equal(result[name]["logits"], ranks[0][name]["logits"]), name


def moe_kernel_logits(group: ParallelGroup) -> dict:
    """A tiny V3's logits with its experts split over the ranks and run in the fused Triton
    kernel (each rank's experts, ``first``), against one process on the torch path."""
    model = tiny_model("v3_like", seed=3)
    ids = torch.randint(0, 97, (TOKENS,), generator=torch.Generator().manual_seed(4))
    full = model.logits(ids)
    shard_model(model, group)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:
        moe.kernels = True
    return dict(error=float((model.logits(ids) - full).abs().max()), spread=float(full.std()),
                first=[m.expert_first for m in moes])


@pytest.mark.triton
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_layers_run_the_fused_kernel_as_one_process(world: int) -> None:
    for rank, r in enumerate(values(run_ranks(moe_kernel_logits, world, timeout_s=300))):
        assert r["spread"] > 0.5
        assert r["error"] <= 1e-4, (rank, r)
        assert set(r["first"]) == {rank * 8 // world}


def test_shard_refuses_uneven_splits() -> None:
    model = tiny_model("v3_like", layers=2)
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) does not split evenly"):
        shard_weights(model, 0, 3)


def test_shard_keeps_each_ranks_share() -> None:
    """Rank 1 of 2 keeps heads 2-3, experts 4-7 and the second half of each MLP's width; the
    latent projections, routers, embeddings and LM head stay whole."""
    whole = tiny_model("v3_like", layers=2)
    model = shard_weights(tiny_model("v3_like", layers=2), 1, 2)
    attn, full_attn = model.model.layers[0].self_attn, whole.model.layers[0].self_attn
    qk = attn.nope + attn.rope_dim
    assert attn.heads == 2 and model.config.num_attention_heads == 2
    assert torch.equal(attn.q_b_proj.weight, full_attn.q_b_proj.weight[2 * qk:])
    assert torch.equal(attn.o_proj.weight, full_attn.o_proj.weight[:, 2 * attn.v_dim:])
    assert torch.equal(attn.kv_a_proj_with_mqa.weight, full_attn.kv_a_proj_with_mqa.weight)
    dense, full_dense = model.model.layers[0].mlp, whole.model.layers[0].mlp
    assert torch.equal(dense.down_proj.weight, full_dense.down_proj.weight[:, 48:])
    moe, full_moe = model.model.layers[1].mlp, whole.model.layers[1].mlp
    assert moe.expert_first == 4 and torch.equal(moe.w13, full_moe.w13[4:])
    assert torch.equal(moe.gate.weight, full_moe.gate.weight)
    assert torch.equal(moe.shared_experts.up_proj.weight, full_moe.shared_experts.up_proj.weight[12:])
    assert torch.equal(model.lm_head.weight, whole.lm_head.weight)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_shares_sum_to_all_experts(world: int) -> None:
    """The routed experts' output is the sum of each rank's share (``first``): assignments to
    other ranks' experts contribute nothing, whatever their ids."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(40, 16, generator=generator)
    w13, w2 = torch.randn(8, 24, 16, generator=generator), torch.randn(8, 16, 12, generator=generator)
    ids = torch.rand(40, 8, generator=generator).argsort(-1)[:, :3]  # 3 distinct experts each
    weights = torch.rand(40, 3, generator=generator)
    whole = grouped_experts(x, w13, w2, weights, ids)
    part = 8 // world
    shares = [grouped_experts(x, w13[r * part:(r + 1) * part], w2[r * part:(r + 1) * part],
                              weights, ids, first=r * part) for r in range(world)]
    torch.testing.assert_close(sum(shares), whole, atol=1e-5, rtol=1e-5)
    assert all(float(s.abs().max()) > 0.1 for s in shares)


def test_the_leader_reads_its_share() -> None:
    """Rank 0 loads only its share (load_shard), bit-identical to loading whole and sharding, in
    every mode: the PIC gate runs through the ranks' engines, not on a whole model."""
    from irminsul.model import default_model_dir, load_model
    from irminsul.parallel.serving import leader_load

    share = leader_load(2)(default_model_dir(), dtype=torch.float32, device="cpu")
    assert share.shard == (0, 2)
    whole = shard_weights(load_model(default_model_dir()), 0, 2)
    assert all(torch.equal(t, whole.state_dict()[n]) for n, t in share.state_dict().items())
