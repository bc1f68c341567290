"""The fused MoE kernel against a naive per-token reference, its block sort's invariants, and MoE's
switch between it and the torch path.

Runs on CUDA, or on a CPU under Triton's interpreter (tests/conftest.py switches it on without CUDA;
there bf16 tiles are multiplied in float32, as the interpreter's bf16 tl.dot is wrong).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fixtures.alignment import check_alignment, naive_alignment

from irminsul.model import parse_config
from irminsul.model.model import use_kernels
from irminsul.model.moe import MoE, grouped_experts

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (run on the GPU machine)")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # of the output's largest magnitude


def naive_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """Each token through each of its k experts in float32, one at a time: [T, D] float32."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    x, w13, w2 = x.float().cpu(), w13.float().cpu(), w2.float().cpu()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e] @ x[t]
            hidden = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(weights[t, j]) * (w2[e] @ hidden)
    return out


def routing(tokens: int, experts: int, k: int, gen: torch.Generator,
            skew: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k of random logits (``skew`` added to the low experts' logits: uneven loads)."""
    logits = torch.randn(tokens, experts, generator=gen)
    logits -= skew * torch.arange(experts) / experts
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    return weights, ids


def problem(tokens: int, experts: int, k: int, dim: int, inter: int, dtype: torch.dtype,
            seed: int = 0, skew: float = 0.0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, dim, generator=gen) / dim ** 0.5).to(dtype)
    w2 = (torch.randn(experts, dim, inter, generator=gen) / inter ** 0.5).to(dtype)
    weights, ids = routing(tokens, experts, k, gen, skew)
    return x, w13, w2, weights, ids


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.cpu().float() - want).abs().max()
    assert err <= TOLERANCE[dtype] * want.abs().max(), float(err)


CASES = {  # tokens, experts, k, dim, inter, skew, tiles (None: the table's)
    "one_token": (1, 8, 2, 32, 32, 0.0, None),
    "odd": (13, 8, 3, 48, 40, 0.0, (16, 16, 32, 4, 2)),  # K and the columns need masks
    "blocks_per_expert": (40, 4, 2, 32, 32, 0.0, (16, 32, 16, 4, 2)),  # ~20 rows per expert
    "empty_experts": (3, 32, 2, 32, 32, 0.0, (16, 32, 32, 4, 2)),  # 26+ experts get nothing
    "uneven": (37, 16, 4, 32, 48, 6.0, (16, 16, 32, 4, 2)),  # low experts take most rows
    "wide_blocks": (21, 8, 3, 64, 32, 3.0, (32, 32, 64, 4, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_match_naive(case: str, dtype: torch.dtype) -> None:
    from irminsul.kernels.fused_moe import MoETiles, fused_experts

    tokens, experts, k, dim, inter, skew, tiles = CASES[case]
    x, w13, w2, weights, ids = problem(tokens, experts, k, dim, inter, dtype, skew=skew)
    want = naive_experts(x, w13, w2, weights, ids)
    got = fused_experts(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)),
                        tiles=MoETiles(*tiles) if tiles else None)
    check(got, want, dtype)


def naive_shared_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                     down: torch.Tensor) -> torch.Tensor:
    """A shared MLP computed whole in float32 on the CPU: [T, D]."""
    xf = x.float().cpu()
    return (F.silu(xf @ gate.float().cpu().T) * (xf @ up.float().cpu().T)) @ down.float().cpu().T


def shared_problem(tokens: int, shared: int, dtype: torch.dtype, seed: int = 0
                   ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor]:
    """8 routed experts (k 3) and a shared MLP of ``shared`` experts' width: (x, w13, w2, the
    weights and ids with the shared columns), (gate, up, down) of the shared MLP, and the
    output computed naively in float32."""
    experts, k, dim, inter = 8, 3, 48, 40
    x, w13, w2, weights, ids = problem(tokens, experts, k, dim, inter, dtype, seed=seed)
    gen = torch.Generator().manual_seed(7)
    gate, up = ((torch.randn(shared * inter, dim, generator=gen) / dim ** 0.5).to(dtype)
                for _ in range(2))
    down = (torch.randn(dim, shared * inter, generator=gen) / inter ** 0.5).to(dtype)
    want = naive_experts(x, w13, w2, weights, ids) + naive_shared_mlp(x, gate, up, down)
    all_ids = torch.cat([ids, (experts + torch.arange(shared)).expand(tokens, shared)], 1)
    all_weights = torch.cat([weights, torch.ones(tokens, shared)], 1)
    return (x, w13, w2, all_weights, all_ids), (gate, up, down), want


@pytest.mark.parametrize("shared", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_mlp_folded_in_as_experts(shared: int, dtype: torch.dtype) -> None:
    """A shared MLP of width S·I read in place as experts E .. E + S − 1 (weight 1): the routed
    experts' naive sum plus the shared MLP computed whole, in float32."""
    from irminsul.kernels.fused_moe import MoETiles, SharedExperts, fused_experts

    problem_, (gate, up, down), want = shared_problem(13, shared, dtype, seed=shared)
    args = [t.to(DEVICE) for t in problem_]
    for tiles in (None, MoETiles(16, 16, 32, 4, 2)):  # one with masked K steps and columns
        got = fused_experts(*args, tiles=tiles,
                            shared=SharedExperts(gate.to(DEVICE), up.to(DEVICE), down.to(DEVICE)))
        check(got, want, dtype)
    with pytest.raises(ValueError, match="whole number"):
        fused_experts(*args, shared=SharedExperts(gate[:-1].to(DEVICE), up[:-1].to(DEVICE),
                                                  down[:, :-1].to(DEVICE)))


@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_experts_sorted_first(tokens: int, dtype: torch.dtype) -> None:
    """An alignment with the shared experts' runs first (the router's at decode sizes): their
    gate/up programs make their own rows instead of reading the sort's (37 tokens: three
    blocks a shared expert, the last part-filled), and the output is the naive one. One that
    sorted another number of them first is refused."""
    from irminsul.kernels import fused_moe as fm

    shared = 2
    (x, w13, w2, weights, ids), mlp, want = shared_problem(tokens, shared, dtype, seed=tokens)
    bins, n = w13.shape[0] + shared, ids.numel()
    shape = fm.AlignShape.of(n, bins, 16)
    rows, owners, used = naive_alignment(ids, bins, 16, lead=shared)
    sorted_rows = torch.full((shape.rows,), n, dtype=torch.int32)
    sorted_rows[:used] = rows
    block_expert = torch.full((shape.blocks,), -1, dtype=torch.int32)
    block_expert[:used // 16] = owners
    aligned = {lead: fm.Alignment(sorted_rows.to(DEVICE), block_expert.to(DEVICE),
                               torch.tensor([used], dtype=torch.int32, device=DEVICE), 16, bins,
                               lead) for lead in (shared, 1)}
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    kwargs = dict(tiles=fm.MoETiles(16, 16, 32, 4, 2),
                  shared=fm.SharedExperts(*(t.to(DEVICE) for t in mlp)))
    check(fm.fused_experts(*args, alignment=aligned[shared], **kwargs), want, dtype)
    with pytest.raises(ValueError, match="1 shared first"):
        fm.fused_experts(*args, alignment=aligned[1], **kwargs)


@ON_GPU
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_router_launch_releases_the_shared_experts_early(tokens: int) -> None:
    """route_aligned then fused_experts as a decode step runs them: captured in a CUDA graph
    (the router releasing the fused MoE as it starts, the shared experts' programs running
    beside it) and replayed on new tokens: the Router's choice through the naive experts."""
    from irminsul.kernels.fused_moe import SharedExperts, fused_experts
    from irminsul.kernels.router import route_aligned

    shared = 2
    (x, w13, w2, _, _), mlp, _ = shared_problem(tokens, shared, torch.bfloat16)
    x, w13, w2 = x.cuda(), w13.cuda(), w2.cuda()
    router = torch.randn(8, x.shape[1], generator=torch.Generator().manual_seed(3)).cuda()
    experts = SharedExperts(*(t.cuda() for t in mlp))

    def step() -> tuple[torch.Tensor, ...]:
        weights, ids, aligned = route_aligned(x, router, top_k=3, method="greedy", groups=1,
                                              topk_group=1, norm=False, scaling=1.0,
                                              block_m=16, shared=shared)
        assert aligned.lead == shared
        return weights, ids, fused_experts(x, w13, w2, weights, ids, shared=experts,
                                           alignment=aligned)

    step()  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids, out = step()
    for seed in (11, 12):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        logits = x.float() @ router.T
        want_w, want_ids = logits.softmax(-1).topk(3, dim=-1)
        assert torch.equal(ids[:, :3].long().cpu(), want_ids.cpu())
        want = naive_experts(x, w13, w2, want_w.cpu(), want_ids.cpu()) + naive_shared_mlp(x, *mlp)
        check(out, want, torch.bfloat16)


def test_a_given_alignment_is_used_and_checked() -> None:
    """An alignment sorted beforehand gives the sort's result; one sorted for other blocks or
    other experts is refused, not read."""
    from irminsul.kernels import fused_moe

    x, w13, w2, weights, ids = (t.to(DEVICE) for t in problem(5, 8, 3, 32, 32, torch.float32,
                                                              seed=2))
    tiles = fused_moe.MoETiles(16, 32, 32, 4, 2)
    aligned = fused_moe.align_blocks(ids, 8, 16)
    got = fused_moe.fused_experts(x, w13, w2, weights, ids, tiles=tiles, alignment=aligned)
    check(got, naive_experts(*(t.cpu() for t in (x, w13, w2, weights, ids))), torch.float32)
    for wrong in (fused_moe.align_blocks(ids, 8, 32), fused_moe.align_blocks(ids, 9, 16)):
        with pytest.raises(ValueError, match="alignment sorted"):
            fused_moe.fused_experts(x, w13, w2, weights, ids, tiles=tiles, alignment=wrong)


def test_sort_in_torch_for_many_assignments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ALIGN_KERNEL_MAX assignments the block sort runs in torch ops: same results."""
    from irminsul.kernels import fused_moe

    monkeypatch.setattr(fused_moe, "ALIGN_KERNEL_MAX", 0)
    x, w13, w2, weights, ids = problem(19, 8, 3, 32, 32, torch.float32, seed=1, skew=4.0)
    got = fused_moe.fused_experts(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)),
                                  tiles=fused_moe.MoETiles(16, 32, 32, 4, 2))
    check(got, naive_experts(x, w13, w2, weights, ids), torch.float32)


@pytest.mark.parametrize("tokens,experts,k,block_m", [(1, 8, 2, 16), (13, 8, 3, 16),
                                                      (40, 4, 2, 16), (3, 32, 2, 32),
                                                      (100, 64, 6, 16), (37, 16, 4, 64)])
def test_block_sort_invariants(tokens: int, experts: int, k: int, block_m: int) -> None:
    """The kernel's sort and the torch sort agree, and both are a stable sort by expert into
    whole blocks: every assignment once, in its expert's run, the rest of each run the sentinel,
    each block labelled with its expert and unused blocks -1."""
    from irminsul.kernels.fused_moe import _align_torch, align_blocks, max_rows

    gen = torch.Generator().manual_seed(tokens)
    _, ids = routing(tokens, experts, k, gen, skew=3.0)
    n = ids.numel()
    rows, blocks = max_rows(n, experts, block_m), max_rows(n, experts, block_m) // block_m
    aligned = align_blocks(ids.to(DEVICE), experts, block_m)
    kernel = [t.cpu() for t in (aligned.rows, aligned.block_expert, aligned.used)]
    torch_sort = [t.cpu() for t in _align_torch(ids.reshape(-1).to(DEVICE), experts, block_m,
                                                rows, blocks)]
    for sorted_rows, block_expert, used_rows in (kernel, torch_sort):
        assert sorted_rows.shape == (rows,) and block_expert.shape == (blocks,)
        check_alignment(ids, experts, block_m, sorted_rows, block_expert, used_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_kernel_switch(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """MoE with kernels on gives the torch path's output (shared experts included); batches above
    KERNEL_MAX_TOKENS stay on the torch path."""
    from irminsul.kernels import fused_moe
    from irminsul.model import moe as moe_module

    config = parse_config(dict(
        model_type="deepseek_v2", vocab_size=10, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=3, first_k_dense_replace=1,
        max_position_embeddings=512, rope_theta=10000))
    torch.manual_seed(0)
    moe = MoE(config).requires_grad_(False)
    for p in moe.parameters():
        p.normal_(0.0, 0.3)
    moe.fuse()
    moe = moe.to(DEVICE, dtype)
    moe.gate.float()  # routers stay float32, as the loader keeps them
    x = torch.randn(11, 32).to(DEVICE, dtype)
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        # torch's grouped GEMM takes bf16 only on CUDA: compare the routed part to the naive loop
        weights, ids = moe.gate(x)
        use_kernels(moe, True)
        got = moe(x) - moe.shared_experts(x)
        check(got, naive_experts(x, moe.w13, moe.w2, weights, ids), dtype)
        return
    want = moe(x)
    use_kernels(moe, True)
    assert moe.kernels
    got = moe(x)
    check(got, want.float().cpu(), dtype)
    monkeypatch.setattr(moe_module, "KERNEL_MAX_TOKENS", 10)
    monkeypatch.setattr(fused_moe, "fused_experts", lambda *_: pytest.fail("fused above the max"))
    torch.testing.assert_close(moe(x), want)


@ON_GPU
@pytest.mark.parametrize("tokens", [1, 8, 64, 300, 2048])
def test_v2_lite_shapes_match_grouped_gemm(tokens: int) -> None:
    """DeepSeek-V2-Lite's expert shapes in bf16 with the default tiles of each token count:
    the fused kernel agrees with the grouped-GEMM path."""
    from irminsul.kernels.fused_moe import fused_experts

    x, w13, w2, weights, ids = (t.cuda() for t in problem(tokens, 64, 6, 2048, 1408,
                                                         torch.bfloat16, seed=tokens))
    want = grouped_experts(x, w13, w2, weights, ids).float()
    got = fused_experts(x, w13, w2, weights, ids).float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


@ON_GPU
def test_fused_experts_replay_in_a_cuda_graph() -> None:
    """A captured call serves any routing of its token count: no host reads, fixed grid."""
    from irminsul.kernels.fused_moe import fused_experts

    x, w13, w2, weights, ids = (t.cuda() for t in problem(24, 16, 4, 64, 64, torch.bfloat16))
    fused_experts(x, w13, w2, weights, ids)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids)
    for seed, skew in ((5, 0.0), (6, 8.0)):
        new_weights, new_ids = routing(24, 16, 4, torch.Generator().manual_seed(seed), skew)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        check(out, naive_experts(x, w13, w2, weights.cpu(), ids.cpu()), torch.bfloat16)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block quantization of one matrix, block by block: float8_e4m3fn values
    and the float32 scale_inv (block amax / 448) that multiplies them back."""
    br, bc = block
    rows, cols = -(-w.shape[0] // br), -(-w.shape[1] // bc)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].float()
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (tile / scale[i, j]).to(q.dtype)
    return q, scale


def dequantize_naive(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each element times its block's scale, one at a time over the blocks (float64)."""
    br, bc = block
    out = q.double()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * br:(i + 1) * br, j * bc:(j + 1) * bc] *= float(scale[i, j])
    return out


FP8_CASES = {  # tokens, experts, k, dim, inter, block, tiles (None: the table's)
    "v3_blocks": (5, 4, 2, 256, 256, (128, 128), None),  # a scale per column per K step
    "partial_blocks": (9, 4, 3, 72, 40, (16, 16), (16, 16, 32, 4, 2)),  # 2-D scale gather
    "oblong_blocks": (7, 8, 2, 64, 48, (32, 16), (16, 32, 16, 4, 2)),  # br != bc, K step = bc
}


@pytest.mark.parametrize("case", list(FP8_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_match_naive_on_dequantized_weights(case: str, dtype: torch.dtype) -> None:
    """float8 w13 / w2 with their block scales (gate and up quantized as the checkpoint holds
    them, each its own grid) give the naive loop's output over the dequantized weights."""
    from irminsul.kernels.fused_moe import ExpertScales, MoETiles, fused_experts

    tokens, experts, k, dim, inter, block, tiles = FP8_CASES[case]
    x, w13, w2, weights, ids = problem(tokens, experts, k, dim, inter, torch.float32, seed=3)
    gate = [quantize_blocks(w[:inter], block) for w in w13]
    up = [quantize_blocks(w[inter:], block) for w in w13]
    down = [quantize_blocks(w, block) for w in w2]
    q13 = torch.stack([torch.cat([g[0], u[0]]) for g, u in zip(gate, up)])
    s13 = torch.stack([torch.cat([g[1], u[1]]) for g, u in zip(gate, up)])
    q2, s2 = torch.stack([d[0] for d in down]), torch.stack([d[1] for d in down])
    dense13 = torch.stack([torch.cat([dequantize_naive(*g, block), dequantize_naive(*u, block)])
                           for g, u in zip(gate, up)])
    dense2 = torch.stack([dequantize_naive(*d, block) for d in down])
    # Rounded to the dtype the dot reads, as dequantizing at load rounds them.
    x = x.to(dtype)
    want = naive_experts(x, dense13.to(dtype), dense2.to(dtype), weights, ids)
    got = fused_experts(*(t.to(DEVICE) for t in (x, q13, q2, weights, ids)),
                        tiles=MoETiles(*tiles) if tiles else None,
                        scales=ExpertScales(s13.to(DEVICE), s2.to(DEVICE), block))
    check(got, want, dtype)
    assert want.abs().max() > 0.1


def test_fp8_expert_scales_that_do_not_fit_are_refused() -> None:
    from irminsul.kernels.fused_moe import ExpertScales, fused_experts

    x, w13, w2, weights, ids = problem(3, 4, 2, 32, 32, torch.float32)
    q13, q2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
    good = ExpertScales(torch.ones(4, 4, 2), torch.ones(4, 2, 2), (16, 16))
    with pytest.raises(ValueError, match=r"w13's scales \(4, 2, 2\)"):
        fused_experts(x, q13, q2, weights, ids,
                      scales=ExpertScales(torch.ones(4, 2, 2), good.w2, (16, 16)))
    with pytest.raises(ValueError, match="not float8_e4m3fn"):
        fused_experts(x, w13, w2, weights, ids, scales=good)


def test_moe_with_fp8_experts_runs_them_in_the_kernel_as_the_torch_path_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A MoE whose experts are FP8Linear (as keep_fp8 loads them) stacks them as float8 with
    their scales; with kernels on, the fused kernel reads them so, at any batch size (above
    KERNEL_MAX_TOKENS too), and gives the torch path's output (which dequantizes them per
    forward)."""
    from irminsul.kernels import fused_moe
    from irminsul.model import moe as moe_module
    from irminsul.model.fp8 import FP8Linear

    config = parse_config(dict(
        model_type="deepseek_v3", vocab_size=10, hidden_size=40, num_hidden_layers=2,
        num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=3, first_k_dense_replace=1, n_group=2,
        topk_group=1, max_position_embeddings=512, rope_theta=10000))
    torch.manual_seed(0)
    moe = MoE(config).requires_grad_(False)
    for p in moe.parameters():
        p.normal_(0.0, 0.3)
    block = (16, 16)
    for expert in moe.experts:
        for name in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(expert, name)
            fp8 = FP8Linear.like(linear, block)
            q, s = quantize_blocks(linear.weight, block)
            fp8.load_state_dict({"weight": q, "weight_scale_inv": s})
            setattr(expert, name, fp8)
    moe.fuse()
    assert moe.w13.dtype == torch.float8_e4m3fn and moe.w13_scale_inv.shape == (8, 4, 3)
    moe = moe.to(DEVICE)
    x = torch.randn(6, 40).to(DEVICE)
    want = moe(x)
    use_kernels(moe, True)
    monkeypatch.setattr(moe_module, "KERNEL_MAX_TOKENS", 2)
    calls = []
    real = fused_moe.fused_experts
    monkeypatch.setattr(fused_moe, "fused_experts",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    got = moe(x)
    assert calls
    check(got, want.float().cpu(), torch.float32)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
def test_expert_parallel_shares_sum_to_all_experts(world: int, fp8: bool) -> None:
    """Under expert parallel each rank's call (its experts, ``first``) gives its share: the
    naive loop over the assignments to its experts only, and the shares sum to the whole."""
    from irminsul.kernels.fused_moe import ExpertScales, MoETiles, fused_experts

    x, w13, w2, weights, ids = problem(11, 8, 3, 32, 32, torch.float32, seed=5, skew=2.0)
    block = (16, 16)
    shares = []
    for rank in range(world):
        part = slice(rank * 8 // world, (rank + 1) * 8 // world)
        local13, local2 = w13[part], w2[part]
        scales = None
        if fp8:
            q13 = [quantize_blocks(w, block) for w in local13]  # 32 rows: gate and up on blocks
            q2 = [quantize_blocks(w, block) for w in local2]
            local13 = torch.stack([q for q, _ in q13])
            local2 = torch.stack([q for q, _ in q2])
            scales = ExpertScales(torch.stack([s for _, s in q13]).to(DEVICE),
                                  torch.stack([s for _, s in q2]).to(DEVICE), block)
        dense13 = (torch.stack([dequantize_naive(*q, block) for q in q13]).float() if fp8
                   else local13)
        dense2 = (torch.stack([dequantize_naive(*q, block) for q in q2]).float() if fp8
                  else local2)
        mine = (ids >= part.start) & (ids < part.stop)
        want = naive_experts(x, dense13, dense2, torch.where(mine, weights, 0.0),
                             torch.where(mine, ids - part.start, 0))
        got = fused_experts(*(t.to(DEVICE) for t in (x, local13, local2, weights, ids)),
                            tiles=MoETiles(16, 16, 16, 4, 2), scales=scales, first=part.start)
        check(got, want, torch.float32)
        shares.append(got.cpu())
    if not fp8:
        check(sum(shares), naive_experts(x, w13, w2, weights, ids), torch.float32)



def test_expert_parallel_tiles_are_sized_by_the_models_experts(monkeypatch) -> None:
    """With ``routed``, a rank's default launch is sized for T·k/routed assignments an expert
    (hand-counted: 64 tokens × 8 of 256 experts is 2 an expert, 16-row blocks), not T·k over its
    own 32 (16 an expert, 32-row blocks); without ``first`` the rank's count stands. The share
    it computes does not change."""
    from irminsul.kernels import fused_moe

    seen = []
    for_tokens = fused_moe.MoETiles.for_tokens.__func__

    def spy(cls, tokens, topk, experts, dtype, fp8=False):  # noqa: ANN001, ANN202
        seen.append((tokens, topk, experts))
        return for_tokens(cls, tokens, topk, experts, dtype, fp8)

    monkeypatch.setattr(fused_moe.MoETiles, "for_tokens", classmethod(spy))
    assert for_tokens(fused_moe.MoETiles, 64, 8, 256, torch.float32).block_m == 16
    assert for_tokens(fused_moe.MoETiles, 64, 8, 32, torch.float32).block_m == 32
    x, w13, w2, weights, ids = problem(64, 8, 8, 32, 32, torch.float32, seed=7)
    ids = (ids * 32 + torch.arange(8)) % 256  # distinct experts of 256 per token
    local = slice(64, 96)
    w13 = w13.repeat(4, 1, 1)[:32]
    w2 = w2.repeat(4, 1, 1)[:32]
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    sized = fused_moe.fused_experts(*args, first=local.start, routed=256)
    own = fused_moe.fused_experts(*args, first=local.start)
    assert seen == [(64, 8, 256), (64, 8, 32)]
    mine = (ids >= local.start) & (ids < local.stop)
    want = naive_experts(x, w13, w2, torch.where(mine, weights, 0.0),
                         torch.where(mine, ids - local.start, 0))
    check(sized, want, torch.float32)
    check(own, want, torch.float32)


def test_a_shared_mlp_under_expert_parallel_is_refused() -> None:
    """Its ids are the model's (E ..), not the rank's: they would land on a local expert."""
    from irminsul.kernels.fused_moe import SharedExperts, fused_experts

    x, w13, w2, weights, ids = problem(3, 4, 2, 32, 32, torch.float32)
    shared = SharedExperts(torch.ones(32, 32), torch.ones(32, 32), torch.ones(32, 32))
    with pytest.raises(ValueError, match="not folded in under expert parallel"):
        fused_experts(x, w13, w2, weights, ids, shared=shared, first=4)


def test_fp8_experts_with_narrow_scale_blocks_keep_two_stages() -> None:
    """Hand-sized: 2048 tokens × 6 of 64 experts (192 an expert) take 128-row tiles; with FP8
    weights in 16-column scale blocks (a scale per weight read beside each weight tile), two
    stages at every size (three asked 240 KB of shared memory, four at 16 rows 258 KB, over an
    H100's 227 KB); DeepSeek-V3's 128 × 128 blocks keep the bfloat16 stages."""
    from irminsul.kernels.fused_moe import MoETiles

    wide = MoETiles.for_tokens(2048, 6, 64, torch.bfloat16)
    assert (wide.block_m, wide.num_stages) == (128, 3)
    assert MoETiles.for_tokens(2048, 6, 64, torch.bfloat16, (16, 16)) == MoETiles(
        128, 128, 64, 8, 2)
    assert MoETiles.for_tokens(64, 6, 64, torch.bfloat16) == MoETiles(16, 64, 128, 4, 4)
    assert MoETiles.for_tokens(64, 6, 64, torch.bfloat16, (16, 16)).num_stages == 2
    assert MoETiles.for_tokens(64, 6, 64, torch.bfloat16, (128, 128)).num_stages == 4
    assert MoETiles.for_tokens(2048, 6, 64, torch.bfloat16, (128, 128)).num_stages == 3
