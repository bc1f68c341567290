"""Split a loaded :class:`MLAModel` across ranks in place: attention heads and dense MLPs tensor
parallel, routed experts expert parallel; embeddings, norms, routers and the LM head replicated.
Or, with ``attention="data"``, only the routed experts split (:mod:`.dispatch`).

What each rank keeps of a layer (W ranks, rank r), under tensor-parallel attention (the default):

* attention: heads ``r·H/W ..`` — their rows of ``q_proj`` / ``q_b_proj`` (Q is head-major,
  ``[H·(P+R), ·]``) and of ``kv_b_proj`` (``[H·(P+V), L]``: each head's W_UK and W_UV), and the
  matching input columns of ``o_proj``. ``q_a_proj`` and ``kv_a_proj_with_mqa`` stay whole: in
  MLA every head reads the same latent row ``[c_KV | k_r]``, so every rank computes the same
  rows and keeps the whole latent pool, and reuse (δ-rotation of ``k_r``) is the same on every
  rank. Splitting the pool instead would need the rows gathered for every head on every layer.
* dense MLP and shared experts: ``I/W`` of the intermediate width (rows of ``gate_proj`` /
  ``up_proj``, columns of ``down_proj``).
* routed experts: experts ``r·E/W ..``. Attention leaves the hidden states replicated, so every
  rank routes every token the same way (the router is replicated and float32) and computes only
  its own experts' share for all tokens; no token is sent anywhere. The shares are summed by the
  same all-reduce that sums the shared experts' partial output: one all-reduce after attention
  and one after the MLP or MoE, per layer, and nothing else in the forward.

So each layer's output is the single-process sum regrouped into W partial sums: the same logits
up to float rounding. The fused Triton MoE kernel runs a rank's experts (``fused_experts``'
``first``). FP8 linears kept as float8 (``keep_fp8``) are split with their scale grids, which the
split must cut on its blocks (:func:`block_share`).

Under data-parallel attention each rank serves its own requests with every head: attention,
dense MLPs and shared experts stay whole (so does the rank's latent pool, which holds only its
own requests' rows), and only the routed experts split, ``r·E/W ..`` as above. A MoE layer sends
each of the rank's token–expert assignments to the expert's rank and gets its output back
(:func:`.dispatch.dispatch`); no all-reduce runs. The logits of each rank's tokens are one
process's on the same tokens, up to float rounding.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from ..config import ATTENTION_MODES, AttentionMode
from ..model import MLAConfig, MLAModel
from ..model.fp8 import FP8Linear
from ..model.mla import MLAttention
from ..model.moe import MLP, MoE
from .dispatch import dispatch
from .group import ParallelGroup, all_reduce


def shard_model(model: MLAModel, group: ParallelGroup,
                attention: AttentionMode = "tensor") -> MLAModel:
    """Keep ``group.rank``'s share of ``model``'s weights and join the layers over ``group``:
    under tensor-parallel ``attention`` every layer's partial outputs summed, under
    data-parallel ``attention`` every MoE layer's assignments sent to their experts' ranks.
    Returns the model. Call it on every rank, after :func:`load_model` (the experts must be
    fused)."""
    shard_weights(model, group.rank, group.world_size, attention)
    if group.world_size > 1:
        for layer in model.model.layers:
            if attention == "tensor":
                layer.reduce = lambda partial: all_reduce(group, partial)
            elif isinstance(layer.mlp, MoE):
                layer.mlp.dispatch = functools.partial(dispatch, group, layer.mlp.gate.experts)
    return model


def check_sharded(model: MLAModel, group: ParallelGroup) -> None:
    """ValueError unless ``model`` is ``group``'s share with its partial outputs summed over the
    group (:func:`shard_model`): a share that is not summed computes wrong logits silently."""
    if group.world_size == 1:
        return
    joined = (all(layer.reduce is not None for layer in model.model.layers)
              if model.attention_mode == "tensor" else
              all(layer.mlp.dispatch is not None for layer in model.model.layers
                  if isinstance(layer.mlp, MoE)))
    if model.shard != (group.rank, group.world_size) or not joined:
        raise ValueError(f"the model is not rank {group.rank} of {group.world_size}'s share "
                         f"summed over the group (its share: {model.shard}): call "
                         f"shard_model(model, group) first")


def shard_weights(model: MLAModel, rank: int, world: int,
                  attention: AttentionMode = "tensor") -> MLAModel:
    """Drop every weight but rank ``rank`` of ``world``'s share (the module docstring lists the
    shares), in place. Under tensor-parallel ``attention``, ``model.config.num_attention_heads``
    becomes the heads this rank computes: the model runner sizes its attention kernel's layout
    from it."""
    config = model.config
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of {world} ranks")
    if model.shard is not None:  # split already (load_shard reads a rank's share directly)
        if model.shard != (rank, world) or model.attention_mode != attention:
            raise ValueError(f"the model is rank {model.shard[0]} of {model.shard[1]}'s share "
                             f"({model.attention_mode}-parallel attention), not rank {rank} of "
                             f"{world}'s ({attention}-parallel attention)")
        return model
    check_divisible(config, world, attention)
    if world == 1:
        return model
    model.attention_mode = attention
    if attention == "data":
        for layer in model.model.layers:
            if isinstance(layer.mlp, MoE):
                _keep_experts(layer.mlp, rank, world)
        model.shard = (rank, world)
        return model
    for layer in model.model.layers:
        _shard_attention(layer.self_attn, rank, world)
        if isinstance(layer.mlp, MoE):
            _shard_moe(layer.mlp, rank, world)
        else:
            _shard_mlp(layer.mlp, rank, world)
    model.config = dataclasses.replace(config, num_attention_heads=config.num_attention_heads
                                       // world)
    model.shard = (rank, world)
    return model


def check_divisible(config: MLAConfig, world: int, attention: AttentionMode = "tensor") -> None:
    """Every split must be even: refuse (ValueError), naming the field, rather than drop a
    remainder. A server checks a checkpoint's config with it before starting any rank."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be split by 'tensor' or 'data', got {attention!r}")
    if attention == "data" and world > 1 and config.n_routed_experts is None:
        raise ValueError("data-parallel attention splits only the routed experts, and this "
                         "model has none: every rank would hold the whole model")
    widths = {} if attention == "data" else {"num_attention_heads": config.num_attention_heads}
    if attention == "tensor" and any(not config.is_moe_layer(i)
                                     for i in range(config.num_hidden_layers)):
        widths["intermediate_size"] = config.intermediate_size
    if config.n_routed_experts is not None:
        widths["n_routed_experts"] = config.n_routed_experts
        if config.n_shared_experts and attention == "tensor":
            widths["moe_intermediate_size × n_shared_experts"] = (
                config.moe_intermediate_size * config.n_shared_experts)
    for name, value in widths.items():
        if value % world:
            raise ValueError(f"{name} ({value}) does not split evenly over {world} ranks")


def split_dims(model: MLAModel) -> dict[str, int]:
    """The dimension along which tensor parallel splits each weight of ``model`` that it splits,
    by state-dict name (the rest are whole on every rank). A property of the architecture: the
    same for a whole model and for any rank's share of it. Rank 0's share of such a weight is
    its leading ``1/world`` along that dimension."""
    dims: dict[str, int] = {}

    def linear(name: str, module: nn.Module, dim: int) -> None:
        for param in ("weight", "weight_scale_inv") + (("bias",) if dim == 0 else ()):
            if getattr(module, param, None) is not None:
                dims[f"{name}.{param}"] = dim

    def mlp(name: str, module: MLP) -> None:
        linear(f"{name}.gate_proj", module.gate_proj, 0)
        linear(f"{name}.up_proj", module.up_proj, 0)
        linear(f"{name}.down_proj", module.down_proj, 1)

    names = {module: name for name, module in model.named_modules()}
    for layer in model.model.layers:  # as shard_weights walks them
        attn = layer.self_attn
        q = "q_proj" if hasattr(attn, "q_proj") else "q_b_proj"
        linear(f"{names[attn]}.{q}", getattr(attn, q), 0)
        linear(f"{names[attn]}.kv_b_proj", attn.kv_b_proj, 0)
        linear(f"{names[attn]}.o_proj", attn.o_proj, 1)
        if isinstance(layer.mlp, MoE):
            for param in ("w13", "w2", "w13_scale_inv", "w2_scale_inv"):
                if getattr(layer.mlp, param, None) is not None:
                    dims[f"{names[layer.mlp]}.{param}"] = 0
            if layer.mlp.shared_experts is not None:
                mlp(names[layer.mlp.shared_experts], layer.mlp.shared_experts)
        else:
            mlp(names[layer.mlp], layer.mlp)
    return dims


def share_of(size: int, rank: int, world: int) -> slice:
    """Rank ``rank`` of ``world``'s even share of ``size`` rows, heads or experts."""
    part = size // world
    return slice(rank * part, (rank + 1) * part)


def block_share(part: slice, size: int, block: int, what: str) -> slice:
    """The scale-grid rows (or columns) of an FP8 weight's ``part`` of ``size`` rows (or
    columns) in blocks of ``block``: the part must start on a block and end on one or at the
    end, or the rank's scales would cover another rank's weights too. ValueError naming
    ``what`` otherwise."""
    if part.start % block or (part.stop % block and part.stop != size):
        raise ValueError(f"{what}: the share {part.start}..{part.stop} of {size} does not fall "
                         f"on the float8 weight's {block}-wide scale blocks; load without "
                         f"keep_fp8 (dequantized) to split it this way")
    return slice(part.start // block, -(-part.stop // block))


def _keep_rows(linear: nn.Linear | FP8Linear, rows: slice, what: str) -> None:
    """An output-split (column-parallel) linear: its rows ``rows`` (and bias; FP8: the rows of
    its scale grid, which must fall on blocks)."""
    if isinstance(linear, FP8Linear):
        grid = block_share(rows, linear.out_features, linear.block[0], what)
        linear.weight_scale_inv = _param(linear.weight_scale_inv.data[grid])
    linear.weight = _param(linear.weight.data[rows])
    if linear.bias is not None:
        linear.bias = _param(linear.bias.data[rows])
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: nn.Linear | FP8Linear, columns: slice, rank: int, what: str) -> None:
    """An input-split (row-parallel) linear: its columns ``columns`` (FP8: and those of its
    scale grid). Its output is a partial sum, so a bias is added by rank 0 alone (the
    all-reduce would add it once per rank)."""
    if isinstance(linear, FP8Linear):
        grid = block_share(columns, linear.in_features, linear.block[1], what)
        linear.weight_scale_inv = _param(linear.weight_scale_inv.data[:, grid])
    linear.weight = _param(linear.weight.data[:, columns])
    if linear.bias is not None and rank != 0:
        linear.bias = _param(torch.zeros_like(linear.bias.data))
    linear.in_features = linear.weight.shape[1]


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.clone(), requires_grad=False)


def _shard_attention(attn: MLAttention, rank: int, world: int) -> None:
    heads = share_of(attn.heads, rank, world)
    qk, kv = attn.nope + attn.rope_dim, attn.nope + attn.v_dim
    q = attn.q_proj if hasattr(attn, "q_proj") else attn.q_b_proj
    _keep_rows(q, slice(heads.start * qk, heads.stop * qk), "attention's query rows")
    _keep_rows(attn.kv_b_proj, slice(heads.start * kv, heads.stop * kv), "kv_b_proj's rows")
    _keep_columns(attn.o_proj, slice(heads.start * attn.v_dim, heads.stop * attn.v_dim), rank,
                  "o_proj's columns")
    attn.heads = heads.stop - heads.start


def _shard_mlp(mlp: MLP, rank: int, world: int) -> None:
    part = share_of(mlp.gate_proj.out_features, rank, world)
    _keep_rows(mlp.gate_proj, part, "the MLP's intermediate width")
    _keep_rows(mlp.up_proj, part, "the MLP's intermediate width")
    _keep_columns(mlp.down_proj, part, rank, "the MLP's intermediate width")


def _shard_moe(moe: MoE, rank: int, world: int) -> None:
    _keep_experts(moe, rank, world)
    if moe.shared_experts is not None:
        _shard_mlp(moe.shared_experts, rank, world)


def _keep_experts(moe: MoE, rank: int, world: int) -> None:
    """The routed experts ``r·E/W ..`` (FP8: with their scales)."""
    if moe.w13 is None or moe.w2 is None:
        raise ValueError("shard the model after its experts are fused (load_model fuses them)")
    experts = share_of(moe.w13.shape[0], rank, world)
    for name in ("w13", "w2", "w13_scale_inv", "w2_scale_inv"):  # FP8 experts: their scales too
        stacked = getattr(moe, name)
        if stacked is not None:
            setattr(moe, name, nn.Parameter(stacked.data[experts].clone(), requires_grad=False))
    moe.expert_first = experts.start
