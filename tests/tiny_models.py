"""Tiny random DeepSeek checkpoints written by transformers (the reference implementation)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

BASE = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
            v_head_dim=16, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
            max_position_embeddings=4096, rms_norm_eps=1e-6)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
        "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}

# name -> (transformers class name, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "v2_lite_like": ("DeepseekV2", dict(q_lora_rank=None, rope_parameters=YARN,
                                        topk_method="greedy")),
    "v2_qlora_group": ("DeepseekV2", dict(q_lora_rank=24, topk_method="group_limited_greedy",
                                          n_group=4, topk_group=2, routed_scaling_factor=16.0,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": 10000.0})),
    "v3_like": ("DeepseekV3", dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                   routed_scaling_factor=2.5,
                                   rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0))),
    "v3_plain_theta": ("DeepseekV3", dict(q_lora_rank=None, n_group=2, topk_group=1,
                                          norm_topk_prob=True, routed_scaling_factor=2.446,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": 50000.0})),
    "v3_half_split": ("DeepseekV3", dict(q_lora_rank=None, n_group=2, topk_group=1,
                                         rope_interleave=False, norm_topk_prob=True,
                                         rope_parameters={"rope_type": "default",
                                                          "rope_theta": 10000.0})),
}


def build(name: str, directory: Path, *, layers: int | None = None, heads: int | None = None,
          seed: int = 0, legacy: bool = False):
    """Save a random transformers model for CASES[name]; return it (eval mode)."""
    import transformers

    family, overrides = CASES[name]
    cfg = {**BASE, **overrides}
    if layers is not None:
        cfg.update(num_hidden_layers=layers, first_k_dense_replace=min(1, layers - 1))
    if heads is not None:
        cfg.update(num_attention_heads=heads, num_key_value_heads=heads)
    config = getattr(transformers, f"{family}Config")(**cfg)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    if legacy:
        to_legacy(directory / "config.json")
    return model


def to_legacy(path: Path) -> None:
    """Rewrite a transformers-5 config.json in the legacy rope_theta + rope_scaling form."""
    raw = json.loads(path.read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    raw["rope_scaling"] = None if kind == "default" else {"type": kind, **params}
    path.write_text(json.dumps(raw))
