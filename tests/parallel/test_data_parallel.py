"""Data-parallel attention with all-to-all expert dispatch on 2 and 4 gloo ranks: each rank runs
its own tokens (of its own length; one rank of four none at all) with every attention head, the
routed experts split over the ranks; each rank's logits equal one process's on its tokens
(1e-5, fp32), through the full forward and through the paged forward the engine drives, for
tiny DeepSeek-V2 and V3 models."""

from __future__ import annotations

import pytest
import torch
from parallel_ranks import run_ranks, values
from tiny_parallel import MODELS, TOKENS, paged_logits, tiny_model

from irminsul.model.moe import MoE, Router, grouped_experts
from irminsul.parallel import ParallelGroup, shard_model, shard_weights
from irminsul.parallel import dispatch as dispatch_module
from irminsul.parallel.dispatch import dispatch


def own_tokens(group: ParallelGroup, seed: int) -> torch.Tensor:
    """This rank's tokens: 24, 19, 14 on ranks 0-2; none on rank 3."""
    n = 0 if group.rank == 3 else TOKENS - 5 * group.rank
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed + group.rank))


def compare(group: ParallelGroup, device: str = "cpu") -> dict:
    out = {}
    for name, (case, overrides) in MODELS.items():
        model = tiny_model(case, seed=1, **overrides).to(device)
        ids = own_tokens(group, 10).to(device)
        # The paged steps are one forward each: every rank the same number of them.
        paged_ids = torch.randint(0, 97, (TOKENS,),
                                  generator=torch.Generator().manual_seed(20 + group.rank)
                                  ).to(device)
        full = model.logits(ids) if len(ids) else None
        paged, ckv, kr = paged_logits(model, paged_ids, prefill=12, span=6)
        shard_model(model, group, attention="data")
        dp_full = model.logits(ids) if len(ids) else model.idle()
        dp_paged, dp_ckv, dp_kr = paged_logits(model, paged_ids, prefill=12, span=6)
        # The same shares without the exchange (each rank its own experts' share of its own
        # tokens): the control that shows a missing dispatch shows.
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        for moe in moes:
            moe.dispatch = None
        local = model.logits(ids) if len(ids) else None
        out[name] = dict(
            tokens=len(ids),
            full=None if full is None else float((dp_full - full).abs().max()),
            paged=float((dp_paged - paged).abs().max()),
            pool=float(max((dp_ckv - ckv).abs().max(), (dp_kr - kr).abs().max())),
            local=None if local is None else float((local - full).abs().max()),
            spread=float(paged.std()),
            heads=model.config.num_attention_heads,
            experts=[m.w13.shape[0] for m in moes],
            first=[m.expert_first for m in moes])
    return out


@pytest.mark.parametrize("world, device", [(2, "cpu"), (4, "cpu"), pytest.param(2, "cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")])])
def test_data_parallel_ranks_match_one_process(world: int, device: str) -> None:
    """On CUDA, two GPUs over NCCL (the torch path in fp32, TF32 off as in the tensor-parallel
    test), each rank against one process on its GPU."""
    ranks = values(run_ranks(compare, world, device, timeout_s=300, device=device))
    for name in MODELS:
        for rank, result in enumerate(ranks):
            r = result[name]
            assert r["spread"] > 0.5, (name, r["spread"])  # 1e-5 is a meaningful bound
            assert r["heads"] == 4  # every head on every rank
            assert r["experts"] == [8 // world] * 2 and r["first"] == [rank * 8 // world] * 2
            assert r["paged"] <= 1e-5, (name, rank, r)
            assert r["pool"] <= 1e-5, (name, rank, r)
            if rank == 3:
                assert r["tokens"] == 0 and r["full"] is None
                continue
            assert r["tokens"] == 24 - 5 * rank
            assert r["full"] <= 1e-5, (name, rank, r)
            assert r["local"] > 1e-2, (name, rank, r)


def routed(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows, expert ids (3 distinct of 8 each) and weights; none on rank 1."""
    mine = torch.Generator().manual_seed(50 + rank)
    tokens = 0 if rank == 1 else 7 + 11 * rank
    x = torch.randn(tokens, 16, generator=mine)
    ids = torch.rand(tokens, 8, generator=mine).argsort(-1)[:, :3]
    return x, ids, torch.rand(tokens, 3, generator=mine)


def exchange(group: ParallelGroup) -> dict:
    """Random rows routed over 8 experts, whose weights every rank knows: the dispatched
    output against the whole grouped GEMM on this rank's rows; the rows this rank received,
    against one for each other rank's token with an expert here."""
    generator = torch.Generator().manual_seed(5)
    w13 = torch.randn(8, 24, 16, generator=generator)
    w2 = torch.randn(8, 16, 12, generator=generator)
    x, ids, weights = routed(group.rank)
    tokens = len(x)
    part = 8 // group.world_size
    mine = range(group.rank * part, (group.rank + 1) * part)
    expected_rows = sum(int(sum(any(int(e) in mine for e in row) for row in routed(r)[1]))
                        for r in range(group.world_size))
    sizes: list[int] = []
    real = dispatch_module.dist.all_to_all_single

    def counted(output, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        sizes.append(output.shape[0])
        return real(output, *args, **kwargs)

    dispatch_module.dist.all_to_all_single = counted
    held = Held(w13, w2, group.rank * part, part)
    out = dispatch(group, 8, x, weights, ids, held)
    dispatch_module.dist.all_to_all_single = real
    whole = grouped_experts(x, w13, w2, weights, ids)
    return dict(error=float((out - whole).abs().max()) if tokens else 0.0,
                shape=tuple(out.shape), scale=float(whole.abs().max()) if tokens else 0.0,
                received=held.seen[0].tolist(), rows=sizes[1], expected_rows=expected_rows)


class Held:
    """Experts ``first .. first + part − 1`` of 8 (the weights ``w13`` / ``w2`` of all): what
    one rank holds, recording the expert ids each call is given."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, first: int, part: int) -> None:
        self.w13, self.w2 = w13[first:first + part], w2[first:first + part]
        self.first, self.seen = first, []

    def local_experts(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        self.seen.append(expert.clone())
        return grouped_experts(rows, self.w13, self.w2, torch.ones(len(rows), 1),
                               expert[:, None], first=self.first)

    def local_weighted(self, rows: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
        self.seen.append(ids.clone())
        return grouped_experts(rows, self.w13, self.w2, weights, ids, first=self.first)


def fixed_exchange(group: ParallelGroup) -> dict:
    """The same routing in fixed sizes (every rank 9 tokens, as a bucket pads them): the
    output against the whole grouped GEMM, the exchanges' sizes, and the assignments this rank
    ran against those of every rank's tokens to its experts."""
    generator = torch.Generator().manual_seed(5)
    w13 = torch.randn(8, 24, 16, generator=generator)
    w2 = torch.randn(8, 16, 12, generator=generator)
    world, part = group.world_size, 8 // group.world_size

    def rows(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mine = torch.Generator().manual_seed(100 + rank)
        return (torch.randn(9, 16, generator=mine),
                torch.rand(9, 8, generator=mine).argsort(-1)[:, :3].to(torch.int32),
                torch.rand(9, 3, generator=mine))

    x, ids, weights = rows(group.rank)
    mine = range(group.rank * part, (group.rank + 1) * part)
    expected = sorted(int(e) for r in range(world) for e in rows(r)[1].reshape(-1)
                      if int(e) in mine)
    sizes: list[tuple[int, ...]] = []
    real = dispatch_module.dist.all_to_all_single

    def counted(output, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        sizes.append(tuple(output.shape))
        return real(output, *args, **kwargs)

    dispatch_module.dist.all_to_all_single = counted
    held = Held(w13, w2, group.rank * part, part)
    with dispatch_module.fixed_capacity():
        out = dispatch(group, 8, x, weights, ids, held)
    dispatch_module.dist.all_to_all_single = real
    whole = grouped_experts(x, w13, w2, weights, ids)
    [ran] = held.seen
    return dict(error=float((out - whole).abs().max()), scale=float(whole.abs().max()),
                sizes=sizes, ran=sorted(int(e) for e in ran.reshape(-1) if e >= 0),
                expected=expected)


@pytest.mark.parametrize("world", [2, 4])
def test_fixed_capacity_dispatch_equals_the_counted_one(world: int) -> None:
    """Fixed sizes (what a CUDA graph replays): three all-to-alls of [W, T, ·], nothing counted;
    each rank's output is still every expert's weighted output on its rows, and each rank ran
    exactly the assignments of every rank's tokens to its own experts."""
    for rank, r in enumerate(values(run_ranks(fixed_exchange, world))):
        assert r["sizes"] == [(world, 9, 16), (world, 9, 6), (world * 9, 16)], r["sizes"]
        assert r["error"] <= 1e-4 * r["scale"], (rank, r["error"])
        assert r["ran"] == r["expected"] and r["ran"], (rank, r)


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_sends_each_assignment_to_its_experts_rank(world: int) -> None:
    """Each rank's output is every expert's weighted output on its rows, rank 1 sending none;
    each rank computed only its own experts' rows, and received each token's row once however
    many of its experts it holds."""
    for rank, r in enumerate(values(run_ranks(exchange, world))):
        tokens = 0 if rank == 1 else 7 + 11 * rank
        assert r["shape"] == (tokens, 16)
        assert r["rows"] == r["expected_rows"] < len(r["received"]), r
        assert r["error"] <= 1e-4 * max(1.0, r["scale"]), (rank, r)
        part = 8 // world
        assert all(rank * part <= e < (rank + 1) * part for e in r["received"]), (rank, r)
        assert len(r["received"]) > 0


def test_data_parallel_split_keeps_attention_and_dense_layers_whole() -> None:
    """Rank 1 of 2 keeps every head, the whole dense MLP and shared expert, and experts 4-7."""
    whole = tiny_model("v3_like", layers=2)
    model = shard_weights(tiny_model("v3_like", layers=2), 1, 2, attention="data")
    assert model.shard == (1, 2) and model.attention_mode == "data"
    assert model.config.num_attention_heads == 4
    for (name, p), (_, q) in zip(model.named_parameters(), whole.named_parameters()):
        if name.endswith((".w13", ".w2")):
            assert torch.equal(p, q[4:]), name
        else:
            assert torch.equal(p, q), name
    assert model.model.layers[1].mlp.expert_first == 4


def test_data_parallel_split_refusals() -> None:
    model = tiny_model("v3_like", layers=2)
    # Heads need not split under data parallel; experts must.
    shard_weights(tiny_model("v3_like", layers=2), 0, 8, attention="data")
    with pytest.raises(ValueError, match="n_routed_experts \\(8\\) does not split evenly over 3"):
        shard_weights(model, 0, 3, attention="data")
    with pytest.raises(ValueError, match="split by 'tensor' or 'data'"):
        shard_weights(model, 0, 2, attention="pipeline")  # type: ignore[arg-type]
    shard_weights(model, 0, 2, attention="data")
    with pytest.raises(ValueError, match="\\(data-parallel attention\\), not rank 0 of 2's "
                                         "\\(tensor-parallel"):
        shard_weights(model, 0, 2)


def kernel_logits(group: ParallelGroup) -> dict:
    """A tiny V3 under data-parallel attention with its routers and each rank's experts (over
    the rows dispatched to it) run in the Triton kernels, against one process on the torch
    path."""
    model = tiny_model("v3_like", seed=3)
    ids = own_tokens(group, 30)
    full = model.logits(ids) if len(ids) else None
    shard_model(model, group, attention="data")
    for module in model.modules():
        if isinstance(module, (MoE, Router)):
            module.kernels = True
    dp = model.logits(ids) if len(ids) else model.idle()
    return dict(error=None if full is None else float((dp - full).abs().max()),
                spread=None if full is None else float(full.std()))


@pytest.mark.triton
@pytest.mark.parametrize("world", [2, 4])
def test_dispatched_rows_run_the_fused_kernel_as_one_process(world: int) -> None:
    for rank, r in enumerate(values(run_ranks(kernel_logits, world, timeout_s=300))):
        if rank == 3:
            assert r["error"] is None
            continue
        assert r["spread"] > 0.5
        assert r["error"] <= 1e-4, (rank, r)
