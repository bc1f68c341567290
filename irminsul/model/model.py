"""A DeepSeek-family MLA decoder (DeepSeek-V2/V3, Kimi-K2, Moonlight) in plain torch.

Module and parameter names mirror the Hugging Face checkpoints (``model.layers.{i}.self_attn.
kv_a_proj_with_mqa.weight`` ...), so the state dict *is* the checkpoint's tensor list.

Two entry points: :meth:`MLAModel.logits` (a full forward from position 0, no cache) and
:meth:`MLAModel.forward`, which takes the per-layer latent rows of cached context plus new tokens at
their absolute positions and returns logits and the new tokens' latent rows — the form a serving
engine drives, whatever mix of exact-prefix rows, reused rows (with k_r re-rotated) and fresh rows
the context holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .config import MLAConfig
from .mla import MLAttention
from .moe import MLP, MoE
from .norm import RMSNorm
from .rope import Rotary


class DecoderLayer(nn.Module):
    def __init__(self, config: MLAConfig, layer: int, rotary: Rotary) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (MoE(config) if config.is_moe_layer(layer)
                    else MLP(config.hidden_size, config.intermediate_size))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: torch.Tensor | None,
                absorbed: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
        attn, rows = self.self_attn(self.input_layernorm(x), positions, context, absorbed=absorbed)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), rows


class Body(nn.Module):
    """Embeddings, decoder layers and the final norm (the checkpoint's ``model.*``)."""

    def __init__(self, config: MLAConfig, rotary: Rotary) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, rotary)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # float32 [T, vocab]
    latents: list[torch.Tensor]  # per layer [T, kv_lora_rank + qk_rope_head_dim], model dtype


class MLAModel(nn.Module):
    """The causal LM: ``.config``, ``.rotary``, ``.logits(ids)``, ``.forward(ids, positions, ctx)``."""

    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = Rotary(config)
        self.model = Body(config, self.rotary)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                context: Sequence[torch.Tensor] | None = None, *,
                absorbed: bool | None = None) -> ForwardOutput:
        """Run new tokens at absolute ``positions`` after ``context`` (one [C, L+R] per layer)."""
        if context is not None and len(context) != len(self.model.layers):
            raise ValueError(f"context has {len(context)} layers, model has "
                             f"{len(self.model.layers)}")
        device = self.lm_head.weight.device
        token_ids, positions = token_ids.to(device), positions.to(device)
        x = self.model.embed_tokens(token_ids)
        latents = []
        for i, layer in enumerate(self.model.layers):
            x, rows = layer(x, positions, None if context is None else context[i], absorbed)
            latents.append(rows)
        return ForwardOutput(self.lm_head(self.model.norm(x)).float(), latents)

    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of a full forward from position 0 without cache."""
        positions = torch.arange(token_ids.shape[0])
        return self.forward(token_ids, positions).logits
