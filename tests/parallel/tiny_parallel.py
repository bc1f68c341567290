"""Tiny random DeepSeek-V2/V3 models for the parallel tests, built in memory (the shapes of
tests/fixtures/tiny_models.py: 4 attention heads, 8 routed experts, one shared, MoE from layer 1),
and the paged forward the engine drives, run over a pool of its own."""

from __future__ import annotations

import torch
from fixtures.tiny_models import BASE, CASES

from irminsul.model import MLAModel, parse_config
from irminsul.model.paged import PagedKV

MODEL_TYPE = {"DeepseekV2": "deepseek_v2", "DeepseekV3": "deepseek_v3"}
# The parallel tests' models: (tests/fixtures/tiny_models.py case, config overrides).
MODELS = {
    "v2": ("v2_lite_like", {}),  # q_proj, YaRN, greedy routing
    "v3": ("v3_like", {}),  # q_lora, YaRN, noaux_tc grouped routing
    # o_proj bias, group-limited routing (its scaling factor of 16 would put fp32 rounding itself
    # at 2e-5 on these logits: naive and absorbed forms of one process differ that much)
    "v2_bias": ("v2_qlora_group", {"attention_bias": True, "routed_scaling_factor": 1.0}),
}
TOKENS = 24


def tiny_model(case: str, *, layers: int = 3, seed: int = 0, **overrides) -> MLAModel:
    """CASES[case]'s config with fresh weights: 2-D weights N(0, 0.2²) (large enough that the
    attention is far from uniform and the router's choices far from ties), norms 1 + N(0, 0.1²),
    the V3 router's bias N(0, 0.1²); experts fused, as the loader leaves them. The same on every
    process for the same arguments."""
    family, extra = CASES[case]
    raw = {**BASE, **extra, **overrides, "model_type": MODEL_TYPE[family],
           "num_hidden_layers": layers, "first_k_dense_replace": min(1, layers - 1)}
    model = MLAModel(parse_config(raw))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=generator))
    model.fuse_experts()
    return model.eval()


def paged_logits(model: MLAModel, ids: torch.Tensor, prefill: int, span: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [len(ids), vocab] of ``ids`` served over a fresh pool as the engine serves them: a
    prefill of ``prefill`` tokens (no context: the naive form), a span of ``span`` tokens after
    it (context: the absorbed form), then one decode step per token; and the pool (c_KV, k_r)
    the forwards wrote."""
    config = model.config
    n = int(ids.shape[0])
    ckv = torch.zeros(config.num_hidden_layers, n, config.kv_lora_rank, device=ids.device)
    kr = torch.zeros(config.num_hidden_layers, n, config.qk_rope_head_dim, device=ids.device)
    steps = [(0, prefill), (prefill, prefill + span)] + [(p, p + 1) for p in range(prefill + span, n)]
    out = []
    for start, stop in steps:
        new = torch.arange(start, stop, device=ids.device)
        context = torch.arange(start, device=ids.device) if start else None
        kv = PagedKV(ckv, kr, new, new, None, None, [(slice(0, stop - start), context, context)])
        hidden = model.hidden_paged(ids[start:stop], new, kv)
        out.append(model.head(hidden, [stop - start], None)[0])
    return torch.cat(out), ckv, kr
