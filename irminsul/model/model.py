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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .config import MLAConfig
from .fp8 import FP8Linear
from .mla import MLAttention
from .moe import MLP, MoE, Router
from .norm import PendingNorm, RMSNorm
from .paged import PagedKV
from .rope import Rotary


class DecoderLayer(nn.Module):
    def __init__(self, config: MLAConfig, layer: int, rotary: Rotary) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, rotary, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (MoE(config) if config.is_moe_layer(layer)
                    else MLP(config.hidden_size, config.intermediate_size))
        # Tensor parallel (irminsul.parallel.shard): each rank's attention and MLP give a partial
        # sum of the output; this sums them over the ranks. None on one process.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.kernels = False  # residual adds fused with the norms after them (use_kernels)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                contexts: Sequence[torch.Tensor | None], lengths: Sequence[int],
                absorbed: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
        attn, rows = self.self_attn(self.input_layernorm(x), positions, contexts, lengths,
                                    absorbed=absorbed)
        return self._mlp(x + self._summed(attn)), rows

    def forward_paged(self, x: torch.Tensor, pending: torch.Tensor | None, positions: torch.Tensor,
                      kv: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer over the pool: ``x`` is the residual stream before this layer, ``pending``
        the previous layer's MLP output not yet added to it (None before the first layer);
        returns the stream after attention and this layer's MLP output, pending in turn — so
        each residual add runs with the norm after it (one launch with kernels on). With kernels
        on, a MoE's pending output is its terms [T, J, D], which that launch sums as well
        (:meth:`settle` sums them elsewhere)."""
        folds = self.kernels and self.self_attn.folds_norm(x, kv)
        if pending is None:
            attended = self.self_attn.forward_paged(self.input_layernorm(x), positions, kv)
        elif folds:  # the joint projection's launch adds and norms (one launch fewer)
            summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            attended = self.self_attn.forward_paged(
                x, positions, kv, PendingNorm(pending, self.input_layernorm, summed))
            x = summed
        else:
            h, x = self._add_norm(self.input_layernorm, x, pending,
                                  release=self.self_attn.reads_ahead(x))
            attended = self.self_attn.forward_paged(h, positions, kv)
        attended = self._summed(attended)
        if (self.kernels and self.reduce is None and isinstance(self.mlp, MoE)
                and self.mlp.dispatch is None):
            # The norm's launch also writes its output widened to float32, which the router
            # reads (its cast was a launch of its own); the experts' terms [T, J, D] are summed
            # by the next add + norm launch (their sum was one too: ~4.8 µs per layer at batch
            # 1 on an H200). Where the next layer folds that add + norm into its joint
            # projection, the experts' last launch releases it so its programs read their
            # weights meanwhile (the same batch: this layer's answer is the next one's).
            widened = torch.empty(x.shape, dtype=torch.float32, device=x.device)
            h, x = self._add_norm(self.post_attention_layernorm, x, attended, widened)
            return x, self.mlp(h, terms=True, widened=widened, release=folds)
        h, x = self._add_norm(self.post_attention_layernorm, x, attended)
        return x, self._summed(self.mlp(h))

    @staticmethod
    def settle(pending: torch.Tensor) -> torch.Tensor:
        """A layer's pending MLP output as [T, D]: its terms summed where it holds them."""
        return pending.sum(1) if pending.dim() == 3 else pending

    def _add_norm(self, norm: RMSNorm, x: torch.Tensor, delta: torch.Tensor,
                  widened: torch.Tensor | None = None, *, release: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + delta), x + delta), the sum rounded to x's dtype before the norm reads it;
        ``delta`` [T, D], or [T, J, D] terms summed first; ``widened``: a float32 [T, D] that
        also receives the normed output as float32; ``release``: the kernel lets the next
        launch start early (one that reads its weights first)."""
        if self.kernels:
            from ..kernels import add_rms_norm  # needs triton: only with kernels

            return add_rms_norm(delta, x, norm.weight, norm.eps, normed_float=widened,
                                release=release)
        x = x + self.settle(delta)
        h = norm(x)
        if widened is not None:
            widened.copy_(h)
        return h, x

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self._summed(self.mlp(self.post_attention_layernorm(x)))

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.reduce is None else self.reduce(partial)


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
        # (rank, world) once irminsul.parallel has kept one rank's share of the weights, and
        # how attention is split: "tensor" (each rank its heads, every request) or "data"
        # (each rank every head, its own requests).
        self.shard: tuple[int, int] | None = None
        self.attention_mode: str = "tensor"
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                context: Sequence[torch.Tensor] | None = None, *,
                absorbed: bool | None = None) -> ForwardOutput:
        """Run new tokens at absolute ``positions`` after ``context`` (one [C, L+R] per layer)."""
        return self.forward_batch([token_ids], [positions], [context], absorbed=absorbed)[0]

    @torch.inference_mode()
    def forward_batch(self, token_ids: Sequence[torch.Tensor], positions: Sequence[torch.Tensor],
                      contexts: Sequence[Sequence[torch.Tensor] | None], *,
                      absorbed: bool | None = None) -> list[ForwardOutput]:
        """A ragged batch: sequence i's new tokens at ``positions[i]`` after ``contexts[i]``.

        Embeddings, projections and the MoE run once over all new tokens; attention per sequence.
        """
        layers = len(self.model.layers)
        for context in contexts:
            if context is not None and len(context) != layers:
                raise ValueError(f"context has {len(context)} layers, model has {layers}")
        device = self.lm_head.weight.device
        lengths = [int(t.shape[0]) for t in token_ids]
        x = self.model.embed_tokens(torch.cat(list(token_ids)).to(device))
        pos = torch.cat(list(positions)).to(device)
        latents = []
        for i, layer in enumerate(self.model.layers):
            per_seq = [None if c is None else c[i] for c in contexts]
            x, rows = layer(x, pos, per_seq, lengths, absorbed)
            latents.append(rows.split(lengths))
        logits = self.lm_head(self.model.norm(x)).float().split(lengths)
        return [ForwardOutput(logits[b], [latents[i][b] for i in range(layers)])
                for b in range(len(lengths))]

    @torch.inference_mode()
    def hidden_paged(self, token_ids: torch.Tensor, positions: torch.Tensor,
                     kv: PagedKV) -> torch.Tensor:
        """The last layer's hidden states [T, D] of a batch over the pool (inputs on the model's
        device): no host work that depends on the batch, so a CUDA graph can capture it."""
        x, pending = self.model.embed_tokens(token_ids), None
        for layer in self.model.layers:
            x, pending = layer.forward_paged(x, pending, positions, kv)
        return x if pending is None else x + DecoderLayer.settle(pending)

    @torch.inference_mode()
    def head(self, x: torch.Tensor, lengths: list[int],
             last: torch.Tensor | None) -> list[torch.Tensor]:
        """Each sequence's logits (float32) from hidden states: [1, vocab] for the rows ``last``
        (one per sequence), or with ``last`` None [n, vocab] for all its ``lengths`` rows."""
        if last is not None:
            # Only the last token's logits start a generation: skip the vocab projection of the
            # rest (for a 16K prompt on a 100K vocabulary, 7 TFLOP and 6.7 GB of logits).
            return list(self.lm_head(self.model.norm(x[last])).float()[:, None])
        return list(self.lm_head(self.model.norm(x)).float().split(lengths))

    @torch.inference_mode()
    def idle(self, start: int = 0, stop: int | None = None) -> None:
        """Under data-parallel attention, the forward of a rank with no tokens in a step its
        peers run: the MoE exchanges of layers ``start`` .. ``stop`` − 1 (default: all),
        joined with no rows (each rank's exchange waits for every other's). Nothing else runs;
        a no-op on one process."""
        embed = self.model.embed_tokens.weight
        for layer in self.model.layers[start:stop]:
            moe = layer.mlp
            if isinstance(moe, MoE) and moe.dispatch is not None:
                k = moe.gate.k
                moe.dispatch(embed.new_empty((0, embed.shape[1])),
                             torch.empty(0, k, dtype=torch.float32, device=embed.device),
                             torch.empty(0, k, dtype=torch.int64, device=embed.device), moe)

    def fuse_experts(self) -> None:
        """Stack every MoE layer's experts for grouped GEMM (after the weights are loaded)."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.fuse()

    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of a full forward from position 0 without cache."""
        positions = torch.arange(token_ids.shape[0])
        return self.forward(token_ids, positions).logits

    @torch.inference_mode()
    def last_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits [vocab] (float32) after ``token_ids`` from a full forward from position 0
        without cache, the vocabulary projection of the last token alone."""
        device = self.lm_head.weight.device
        token_ids = token_ids.to(device)
        x = self.model.embed_tokens(token_ids)
        positions = torch.arange(token_ids.shape[0], device=device)
        for layer in self.model.layers:
            x, _ = layer(x, positions, [None], [token_ids.shape[0]], None)
        return self.lm_head(self.model.norm(x[-1:])).float()[0]


def use_kernels(model: nn.Module, on: bool) -> None:
    """Switch every module of ``model`` that has Triton kernels to them (``on``) or to torch:
    the MoE's fused experts and router, the attention's fused latent store and query (its two
    projections of x joined into one weight), the residual adds fused with their norms, FP8
    linears read as float8. Kernels need triton (CUDA,
    or its CPU interpreter)."""
    for module in model.modules():
        if isinstance(module, (MoE, Router, MLAttention, DecoderLayer, FP8Linear)):
            module.kernels = on
        if on and isinstance(module, MLAttention):
            module.join_projections()
