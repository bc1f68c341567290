"""MoE routing and sort-based dispatch against naive per-token computations."""

from __future__ import annotations

import pytest
import torch

from irminsul.model import parse_config
from irminsul.model.moe import MoE

BASE = dict(vocab_size=10, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
            intermediate_size=48, moe_intermediate_size=12, n_routed_experts=8,
            n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1,
            max_position_embeddings=512, rope_theta=10000)
ROUTING = {
    "v2_greedy": dict(model_type="deepseek_v2", topk_method="greedy", routed_scaling_factor=1.5),
    "v2_group": dict(model_type="deepseek_v2", topk_method="group_limited_greedy", n_group=4,
                     topk_group=2, routed_scaling_factor=16.0),
    "v2_norm": dict(model_type="deepseek_v2", topk_method="greedy", norm_topk_prob=True),
    "v3": dict(model_type="deepseek_v3", n_group=4, topk_group=2, norm_topk_prob=True,
               routed_scaling_factor=2.5),
}


def _naive_route(moe: MoE, x: torch.Tensor, name: str) -> list[dict[int, float]]:
    """Per token, written from the routing rules in plain Python: expert -> weight."""
    cfg = ROUTING[name]
    gate = moe.gate
    out = []
    for row in x:
        logits = [float(w @ row) for w in gate.weight]
        size = 8 // cfg.get("n_group", 1)
        if name == "v3":
            scores = [1 / (1 + torch.e ** -v) for v in logits]
            choice = [s + float(b) for s, b in zip(scores, gate.e_score_correction_bias)]
            groups = [sorted(choice[g * size:(g + 1) * size])[-2:] for g in range(4)]
            kept = sorted(range(4), key=lambda g: -sum(groups[g]))[:2]
            allowed = [e for e in range(8) if e // size in kept]
            chosen = sorted(allowed, key=lambda e: -choice[e])[:3]
            total = sum(scores[e] for e in chosen)
            out.append({e: scores[e] / (total + 1e-20) * 2.5 for e in chosen})
            continue
        z = sum(torch.e ** v for v in logits)
        p = [torch.e ** v / z for v in logits]
        if name == "v2_group":
            kept = sorted(range(4), key=lambda g: -max(p[g * size:(g + 1) * size]))[:2]
            p = [v if e // size in kept else 0.0 for e, v in enumerate(p)]
        chosen = sorted(range(8), key=lambda e: -p[e])[:3]
        if cfg.get("norm_topk_prob"):
            total = sum(p[e] for e in chosen)
            out.append({e: p[e] / (total + 1e-20) for e in chosen})
        else:
            out.append({e: p[e] * cfg.get("routed_scaling_factor", 1.0) for e in chosen})
    return out


@pytest.mark.parametrize("name", list(ROUTING))
def test_routing_and_dispatch_match_naive(name: str) -> None:
    config = parse_config({**BASE, **ROUTING[name]})
    torch.manual_seed(0)
    moe = MoE(config).requires_grad_(False)
    for p in moe.parameters():
        p.normal_(0.0, 0.3)
    x = torch.randn(40, 32, dtype=torch.float64).float()
    weights, ids = moe.gate(x)
    routes = _naive_route(moe, x, name)
    for t, route in enumerate(routes):
        got = {int(e): float(w) for e, w in zip(ids[t], weights[t])}
        assert got.keys() == route.keys(), t
        for e in route:
            assert got[e] == pytest.approx(route[e], rel=1e-5)
    expected = torch.stack([
        sum(w * moe.experts[e](x[t]) for e, w in route.items()) + moe.shared_experts(x[t])
        for t, route in enumerate(routes)])
    with pytest.raises(RuntimeError, match="not fused"):
        moe(x)
    moe.fuse()  # stack the experts for grouped GEMM, as load_model does
    assert moe.experts is None
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-4)
