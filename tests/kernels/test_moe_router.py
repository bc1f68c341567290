"""The fused router kernel against :class:`irminsul.model.moe.Router` built from small configs.

Runs on CUDA, or on a CPU under Triton's interpreter (tests/conftest.py switches it on without CUDA).
The kernel upcasts x before its float32 dot, as the Router does, so bf16 inputs match as closely as
float32 ones: ids exactly, weights to float32 rounding (different summation orders).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fixtures.alignment import check_alignment

from irminsul.model import parse_config
from irminsul.model.moe import Router

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (run on the GPU machine)")
DIM = 48  # not a multiple of the kernel's D step: the last step is masked

CASES: dict[str, dict[str, Any]] = {  # config fields of each router
    "greedy": dict(n_routed_experts=16, num_experts_per_tok=4),
    "greedy_scaled": dict(n_routed_experts=16, num_experts_per_tok=4, routed_scaling_factor=2.5),
    "greedy_norm": dict(n_routed_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                        routed_scaling_factor=2.5),  # renormalised, not scaled
    "greedy_k1_norm": dict(n_routed_experts=8, num_experts_per_tok=1, norm_topk_prob=True,
                           routed_scaling_factor=2.5),  # k = 1: scaled, not renormalised
    "group_limited": dict(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
                          topk_method="group_limited_greedy", routed_scaling_factor=2.5),
    # 20 experts pad to 32; groups of 5 (DeepSeek-V2's 160 experts in 8 groups: 20 each)
    "group_limited_odd": dict(n_routed_experts=20, num_experts_per_tok=3, n_group=4, topk_group=2,
                              topk_method="group_limited_greedy", norm_topk_prob=True),
    "noaux_tc": dict(model_type="deepseek_v3", n_routed_experts=32, num_experts_per_tok=4,
                     n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    "noaux_tc_v3_shape": dict(model_type="deepseek_v3", n_routed_experts=256,
                              num_experts_per_tok=8, n_group=8, topk_group=4,
                              norm_topk_prob=True, routed_scaling_factor=2.5),
    "noaux_tc_k1_plain": dict(model_type="deepseek_v3", n_routed_experts=8, num_experts_per_tok=1,
                              routed_scaling_factor=1.5),  # one group; not renormalised
}


def make_router(case: str, seed: int = 0) -> Router:
    fields = dict(model_type="deepseek_v2", vocab_size=10, hidden_size=DIM, num_hidden_layers=2,
                  num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                  max_position_embeddings=512, rope_theta=10000)
    router = Router(parse_config({**fields, **CASES[case]})).requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 0.3)
    if router.v3:  # large enough to change the choice (test_cases_exercise_their_rules)
        router.e_score_correction_bias.copy_(torch.randn(router.experts, generator=gen) * 0.3)
    return router.to(DEVICE)


def kernel_route(router: Router, x: torch.Tensor, **extra: Any) -> tuple[torch.Tensor, ...]:
    from irminsul.kernels.router import route

    return route(x, router.weight, top_k=router.k, method=router.method, groups=router.groups,
                 topk_group=router.topk_group, norm=router.norm, scaling=router.scaling,
                 bias=router.e_score_correction_bias if router.v3 else None, **extra)


def tokens(count: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(count, DIM, generator=gen).to(DEVICE, dtype)


def check(router: Router, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
    want_w, want_ids = router(x)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape[0] == ids.shape[0] == x.shape[0]
    k = router.k
    assert torch.equal(ids[:, :k].long().cpu(), want_ids.cpu())
    torch.testing.assert_close(weights[:, :k].cpu(), want_w.cpu(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("count", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_route_matches_router(case: str, dtype: torch.dtype, count: int) -> None:
    router = make_router(case)
    x = tokens(count, dtype)
    weights, ids = kernel_route(router, x)
    assert weights.shape == ids.shape == (count, router.k)
    check(router, x, weights, ids)


@pytest.mark.parametrize("shared_first", [True, False], ids=["shared_first", "in_order"])
@pytest.mark.parametrize("count", [1, 5, 16, 17])
@pytest.mark.parametrize("case", ["greedy_norm", "group_limited_odd", "noaux_tc",
                                  "noaux_tc_v3_shape"])
def test_route_aligned_routes_and_sorts(case: str, count: int, shared_first: bool,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """One launch up to 16 tokens (its own GEMV, the last program choosing and sorting), route
    then the sort above: the Router's choice, and a stable sort of it into whole blocks (the
    one launch: the shared experts' runs first, while SHARED_FIRST); the count it keeps between
    launches is back at zero, so a second call gives the same again."""
    from irminsul.kernels import router as module

    monkeypatch.setattr(module, "SHARED_FIRST", shared_first)
    router = make_router(case)
    for seed in (1, 2):
        x = tokens(count, torch.bfloat16, seed=seed)
        weights, ids, aligned = module.route_aligned(
            x, router.weight, top_k=router.k, method=router.method, groups=router.groups,
            topk_group=router.topk_group, norm=router.norm, scaling=router.scaling,
            bias=router.e_score_correction_bias if router.v3 else None, shared=2, block_m=16)
        assert weights.shape == ids.shape == (count, router.k + 2)
        check(router, x, weights, ids)
        lead = 2 if shared_first and count <= module.ALIGNED_MAX_TOKENS else 0
        assert (aligned.block_m, aligned.bins, aligned.lead) == (16, router.experts + 2, lead)
        check_alignment(ids, router.experts + 2, 16, aligned.rows, aligned.block_expert,
                        aligned.used, lead)
        assert int(module._counter(x.device)) == 0


@pytest.mark.parametrize("count", [1, 8])
def test_route_aligned_over_a_wide_hidden_size(count: int, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    """A hidden size of 1,040: one token reads each program's weight rows in one pass; eight
    tokens step over D in 512s, the last step masked."""
    import sys

    from irminsul.kernels import router as module

    this = sys.modules[__name__]
    monkeypatch.setattr(this, "DIM", 1040)
    router = make_router("greedy_norm")
    x = tokens(count, torch.float32)
    weights, ids, aligned = module.route_aligned(
        x, router.weight, top_k=router.k, method=router.method, groups=router.groups,
        topk_group=router.topk_group, norm=router.norm, scaling=router.scaling, shared=0,
        block_m=16)
    check(router, x, weights, ids)
    check_alignment(ids, router.experts, 16, aligned.rows, aligned.block_expert, aligned.used, 0)


@pytest.mark.parametrize("case", ["greedy_norm", "noaux_tc"])
def test_shared_columns(case: str) -> None:
    router = make_router(case)
    x = tokens(7, torch.float32)
    for total, first in ((None, router.experts), (100, 100)):
        weights, ids = kernel_route(router, x, shared=2, experts_total=total)
        assert weights.shape == ids.shape == (7, router.k + 2)
        check(router, x, weights, ids)
        assert torch.equal(weights[:, router.k:].cpu(), torch.ones(7, 2))
        assert torch.equal(ids[:, router.k:].cpu(), torch.tensor([[first, first + 1]] * 7,
                                                                 dtype=torch.int32))


def test_strided_rows() -> None:
    """x a column slice of a wider buffer (row stride > D), read in place."""
    router = make_router("noaux_tc")
    wide = torch.randn(9, DIM + 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    x = wide[:, 8:8 + DIM]
    assert x.stride(0) == DIM + 16
    check(router, x, *kernel_route(router, x))


def test_no_tokens_no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from irminsul.kernels import router as module

    monkeypatch.setattr(module, "_router_kernel", None)  # a launch would fail
    router = make_router("noaux_tc")
    weights, ids = kernel_route(router, tokens(0, torch.bfloat16), shared=1)
    assert weights.shape == ids.shape == (0, router.k + 1)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_ties_go_to_the_lowest_index(method: str) -> None:
    """A zero weight ties every expert and every group: experts 0..k-1, from groups 0 and 1 (k 6
    over groups of 4, so a wrong group choice shows)."""
    from irminsul.kernels.router import route

    x = tokens(3, torch.float32)
    w = torch.zeros(16, DIM, device=DEVICE)
    bias = torch.zeros(16, device=DEVICE) if method == "noaux_tc" else None
    weights, ids = route(x, w, top_k=6, method=method, groups=4, topk_group=2, norm=True,
                         scaling=1.0, bias=bias)
    assert torch.equal(ids.cpu(), torch.arange(6, dtype=torch.int32).expand(3, 6))
    torch.testing.assert_close(weights.cpu(), torch.full((3, 6), 1 / 6))


def test_fewer_kept_experts_than_k() -> None:
    """V2 group limiting zeroes the dropped experts' scores, and top-k may still pick them: weight
    0 (the Router's zeros; torch.topk's order among them is unspecified, the kernel's the lowest
    index)."""
    router = make_router("group_limited")
    router.k, router.topk_group = 10, 2  # 2 groups of 4 kept
    x = tokens(5, torch.float32)
    weights, ids = kernel_route(router, x)
    want_w, want_ids = router(x)
    torch.testing.assert_close(weights.cpu(), want_w.cpu(), rtol=1e-5, atol=1e-7)
    assert torch.equal(ids[:, :8].long().cpu(), want_ids[:, :8].cpu())
    assert torch.equal(weights[:, 8:].cpu(), torch.zeros(5, 2))
    kept = ids[:, :8].long().cpu() // 4
    for row, picked in zip(kept, ids[:, 8:].long().cpu(), strict=True):
        dropped = [e for e in range(16) if e // 4 not in row.tolist()]
        assert picked.tolist() == dropped[:2]


def test_cases_exercise_their_rules() -> None:
    """The cases are not vacuous: group limiting and the bias change some token's experts."""
    x = tokens(33, torch.float32)
    for case in ("group_limited", "group_limited_odd", "noaux_tc", "noaux_tc_v3_shape"):
        router = make_router(case)
        _, grouped = router(x)
        router.groups = 1  # the Router's _keep_groups then keeps every expert
        _, free = router(x)
        assert not torch.equal(grouped, free), case
        if router.v3:
            router.e_score_correction_bias.zero_()
            _, unbiased = router(x)
            assert not torch.equal(free, unbiased), case


def test_bad_arguments() -> None:
    from irminsul.kernels.router import route

    x = torch.zeros(2, DIM, device=DEVICE)
    w = torch.zeros(16, DIM, device=DEVICE)
    bias = torch.zeros(16, device=DEVICE)
    ok = dict(top_k=2, method="greedy", groups=4, topk_group=2, norm=False, scaling=1.0)
    bad = [
        (dict(x=x[0]), "must be \\[T, D\\]"),
        (dict(weight=w[:, :-1]), "must be \\[T, D\\]"),
        (dict(weight=w.bfloat16()), "weight float32"),
        (dict(method="softmax"), "method 'softmax'"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=17), "top_k"),
        (dict(groups=3), "groups \\(3\\)"),
        (dict(topk_group=5), "topk_group"),
        (dict(topk_group=0), "topk_group"),
        (dict(method="noaux_tc"), "bias"),
        (dict(bias=bias), "bias"),
        (dict(method="noaux_tc", bias=bias[:8]), "bias must be float32 \\[16\\]"),
        (dict(shared=-1), "shared"),
        (dict(shared=1, experts_total=8), "experts_total"),
    ]
    for change, message in bad:
        args = {"x": x, "weight": w, **ok, **change}
        with pytest.raises(ValueError, match=message):
            route(args.pop("x"), args.pop("weight"), **args)


@ON_GPU
def test_graph_capture() -> None:
    """Captured once, replayed on new tokens in the same buffer."""
    router = make_router("noaux_tc_v3_shape")
    x = tokens(5, torch.bfloat16)
    kernel_route(router, x, shared=1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = kernel_route(router, x, shared=1)
    x.copy_(tokens(5, torch.bfloat16, seed=7))
    graph.replay()
    torch.cuda.synchronize()
    check(router, x, weights, ids)


@ON_GPU
def test_route_aligned_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed on new tokens twice: the Router's choice and its sort each time
    (the launch's count of finished programs is reset by its last one, not by the capture)."""
    from irminsul.kernels.router import route_aligned

    router = make_router("noaux_tc_v3_shape")
    x = tokens(3, torch.bfloat16)

    def call() -> tuple[torch.Tensor, ...]:
        return route_aligned(x, router.weight, top_k=router.k, method=router.method,
                             groups=router.groups, topk_group=router.topk_group, norm=router.norm,
                             scaling=router.scaling, bias=router.e_score_correction_bias,
                             shared=1, block_m=16)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids, aligned = call()
    for seed in (7, 8):
        x.copy_(tokens(3, torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        check(router, x, weights, ids)
        check_alignment(ids, router.experts + 1, 16, aligned.rows, aligned.block_expert,
                        aligned.used, aligned.lead)
