"""Load one rank's share of a checkpoint, reading only what the rank keeps.

:func:`~irminsul.parallel.shard.shard_weights` splits a model that is already whole in memory:
every rank reads every tensor, the routed experts of all ranks included. For the models agents
run (DeepSeek-V3 / Kimi-K2: 58 MoE layers × 256 experts, ~1.3 TB in bf16) no rank can hold the
whole model, so :func:`load_shard` builds the rank's model directly: each tensor is read as the
slice the rank keeps (safetensors reads only those bytes), routed experts of other ranks are
never read, and the experts it keeps are written straight into their stacked ``w13`` / ``w2``.

The split is :func:`shard_weights`' own, applied to a model on the meta device: that gives every
parameter's sharded shape; the slices below must fill exactly those shapes (any tensor that does
not is an error naming it), and a test checks the result equals loading whole and sharding, bit
for bit. Float8 weights are dequantized whole (their block scales cover whole blocks), then
sliced — or, with ``keep_fp8``, read as float8 slices with the rows or columns of their scale
grids (the split must fall on the blocks), the routed experts stacked as float8 with their scales:
what ``shard_weights(load_model(path, keep_fp8=True), rank, world)`` leaves, no weight of the
rank's ever dequantized.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..config import AttentionMode
from ..model import MLAConfig, MLAModel
from ..model.config import load_config
from ..model.loader import (
    FP32_PARAMS,
    CheckpointError,
    dequantize_weight,
    float8_names,
    float8_scale,
    install,
    keep_float8_linears,
    missing_tensors,
    scale_file,
    used_tensors,
)
from ..model.rope import audit_rotary
from .shard import block_share, check_divisible, shard_weights, share_of

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def load_shard(path: str | os.PathLike, rank: int, world: int, *,
               dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", keep_fp8: bool = False,
               attention: AttentionMode = "tensor") -> MLAModel:
    """Rank ``rank`` of ``world``'s share of the checkpoint at ``path``: what
    ``shard_weights(load_model(path, dtype=dtype, keep_fp8=keep_fp8), rank, world, attention)``
    leaves, read without loading the rest. Raises ValueError where the model does not split evenly over
    ``world`` ranks (with ``keep_fp8``: or a split does not fall on the scale blocks) and
    :class:`~irminsul.model.loader.CheckpointError` for a tensor missing, unexpected or of the
    wrong shape."""
    config = load_config(path)
    check_divisible(config, world, attention)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of {world} ranks")
    with torch.device("meta"):
        model = MLAModel(config)
        kept = (keep_float8_linears(model, float8_names(path, config), config.quantization)
                if keep_fp8 else set())
        model.fuse_experts()
        # Every tensor's whole shape: a rank reads a slice, and a slice of a misshapen tensor
        # can have the share's shape (extra heads or rows past the config's would be dropped).
        whole = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        shard_weights(model, rank, world, attention)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    slices = _Slices(config, rank, world, attention)
    # The stacked experts are filled row by row from per-expert tensors: each one this rank
    # keeps must be read, or its row would be left as whatever the allocation held.
    owed = {f"{stacked[:-len('.w13')]}.experts.{e}.{proj}_proj.weight"
            for stacked in expected if stacked.endswith(".mlp.w13")
            for e in slices.experts for proj in ("gate", "up", "down")}
    state: dict[str, torch.Tensor] = {}
    for name, read in _tensors(Path(path), config, kept):
        target = torch.float32 if name.endswith(FP32_PARAMS) else dtype
        expert = _EXPERT.match(name)
        if expert is not None:
            _place_expert(state, expected, expert, read, slices, target, device, path)
            owed.discard(name)
            continue
        if name not in expected:
            raise CheckpointError(f"{path}: unexpected tensor {name}")
        shapes = {name: read.shape()}
        if read.kept:
            shapes[name + "_scale_inv"] = read.scale_shape()
        for part, shape in shapes.items():
            if shape != whole[part]:
                raise CheckpointError(f"{path}: tensor {part} has shape {shape}, config.json "
                                      f"implies {whole[part]}")
        index = slices.index(name)
        parts = {name: slices.of(name, read, index)}
        if read.kept:  # float8 as stored, with its scales' rows or columns
            parts[name + "_scale_inv"] = read.scale(
                _grid_index(index, read, config.quantization.block, name))
        for part, tensor in parts.items():
            if tuple(tensor.shape) != expected[part]:
                raise CheckpointError(f"{path}: tensor {part} gives rank {rank} of {world} "
                                      f"{tuple(tensor.shape)}, expected {expected[part]}")
            # A kept weight stays float8 and its scales float32 (read.scale gives them so).
            kind = target if part == name and not read.kept else tensor.dtype
            state[part] = tensor.to(device=device, dtype=kind)
    if owed:
        raise missing_tensors(path, owed)
    install(model, state, expected, path)
    audit_rotary(model.rotary, config)
    return model.eval()


class _Slices:
    """What rank ``rank`` keeps of each tensor: the same shares as :mod:`.shard`'s."""

    def __init__(self, config: MLAConfig, rank: int, world: int,
                 attention: AttentionMode) -> None:
        self.config, self.rank, self.world = config, rank, world
        self.whole = attention == "data"  # only the routed experts split
        self.heads = share_of(config.num_attention_heads, rank, world)
        experts = share_of(config.n_routed_experts or 0, rank, world)
        self.experts = range(experts.start, experts.stop)

    def index(self, name: str) -> tuple[slice, ...]:
        """The rank's rows, or columns, of tensor ``name`` (``()``: all of it)."""
        c, h = self.config, self.heads
        if self.whole:
            return ()
        if name.endswith((".self_attn.q_proj.weight", ".self_attn.q_b_proj.weight")):
            return (slice(h.start * c.qk_head_dim, h.stop * c.qk_head_dim),)
        if name.endswith(".self_attn.kv_b_proj.weight"):
            width = c.qk_nope_head_dim + c.v_head_dim
            return (slice(h.start * width, h.stop * width),)
        if name.endswith(".self_attn.o_proj.weight"):
            return (slice(None), slice(h.start * c.v_head_dim, h.stop * c.v_head_dim))
        mlp = re.search(r"\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.weight$", name)
        if mlp is not None:
            width = (c.moe_intermediate_size * c.n_shared_experts if mlp.group(1)
                     else c.intermediate_size)
            part = share_of(width, self.rank, self.world)
            return (slice(None), part) if mlp.group(2) == "down" else (part,)
        return ()

    def of(self, name: str, read: _Read, index: tuple[slice, ...]) -> torch.Tensor:
        """The rank's part of tensor ``name``, read through ``read``."""
        if name.endswith(".self_attn.o_proj.bias") and not self.whole:
            # A row-parallel output is a partial sum: rank 0 alone adds the bias.
            bias = read(())
            return bias if self.rank == 0 else torch.zeros_like(bias)
        return read(index)


def _grid_index(index: tuple[slice, ...], read: _Read, block: tuple[int, int],
                name: str) -> tuple[slice, ...]:
    """The scale grid's rows or columns of a float8 weight's share ``index`` (on blocks)."""
    shape = read.shape()
    return tuple(part if part == slice(None) else
                 block_share(part, shape[dim], block[dim], name)
                 for dim, part in enumerate(index))


def _place_expert(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                  match: re.Match, read: _Read, slices: _Slices, dtype: torch.dtype,
                  device: str | torch.device, path: str | os.PathLike) -> None:
    """A routed expert's gate / up / down weight into this rank's stacked w13 / w2 (read only
    if the expert is this rank's)."""
    prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
    if expert not in slices.experts:
        return
    name = f"{prefix}.{'w2' if proj == 'down' else 'w13'}"
    if name not in expected:
        raise CheckpointError(f"{path}: unexpected tensor {match.group(0)}")
    parts = [(name, read(()), torch.float8_e4m3fn if read.kept else dtype)]
    if read.kept:  # FP8 experts: the weight as stored, its scale grid into the stacked grids
        parts.append((name + "_scale_inv", read.scale(()), torch.float32))
    for stacked, tensor, kind in parts:
        stack = state.get(stacked)
        if stack is None:
            stack = state[stacked] = torch.empty(expected[stacked], dtype=kind, device=device)
        row = stack[expert - slices.experts.start]
        half = stack.shape[1] // 2  # w13: the gate's rows (or grid rows), then the up's
        into = row if proj == "down" else row[:half] if proj == "gate" else row[half:]
        if tuple(tensor.shape) != tuple(into.shape):
            raise CheckpointError(f"{path}: tensor {match.group(0)}{stacked[len(name):]} has "
                                  f"shape {tuple(tensor.shape)}, expected {tuple(into.shape)}")
        into.copy_(tensor)


class _Read:
    """One checkpoint tensor, read on demand as an index of it: a slice read from the file
    (only those bytes), or for a float8 weight its dequantized float32 whole, then indexed —
    unless it is ``kept`` (``keep_fp8``): then float8 slices, and :meth:`scale` reads its
    scale grid's."""

    def __init__(self, handle: Any, name: str, dequantize: Callable[[], torch.Tensor] | None,
                 scales: Path | None = None, shard: Path | None = None) -> None:
        self.handle, self.name, self.dequantize = handle, name, dequantize
        self.scales, self.shard = scales, shard  # kept: the file of its scale grid, its own

    @property
    def kept(self) -> bool:
        return self.scales is not None

    def shape(self) -> tuple[int, ...]:
        return tuple(self.handle.get_slice(self.name).get_shape())

    def scale_shape(self) -> tuple[int, ...]:
        """The whole shape of a kept weight's ``weight_scale_inv``."""
        name = self.name + "_scale_inv"
        if self.scales == self.shard:
            return tuple(self.handle.get_slice(name).get_shape())
        with safe_open(str(self.scales), framework="pt") as g:
            return tuple(g.get_slice(name).get_shape())

    def __call__(self, index: tuple[slice, ...]) -> torch.Tensor:
        if self.dequantize is not None:
            return self.dequantize()[index]
        view = self.handle.get_slice(self.name)
        return view[index] if index else view[:]

    def scale(self, index: tuple[slice, ...]) -> torch.Tensor:
        """Rows or columns ``index`` of a kept weight's ``weight_scale_inv``, float32."""
        name = self.name + "_scale_inv"
        if self.scales == self.shard:
            view = self.handle.get_slice(name)
            return (view[index] if index else view[:]).float()
        with safe_open(str(self.scales), framework="pt") as g:
            view = g.get_slice(name)
            return (view[index] if index else view[:]).float()


def _tensors(path: Path, config: MLAConfig, kept: set[str]) -> Iterator[tuple[str, _Read]]:
    """(name, reader) for every tensor the model uses (``used_tensors``); ``kept``: the float8
    weights read as float8."""
    for shard, f, name, home in used_tensors(path, config):
        if not f.get_slice(name).get_dtype().startswith("F8"):
            yield name, _Read(f, name, None)
        elif name in kept:
            if f.get_slice(name).get_dtype() != "F8_E4M3":
                raise CheckpointError(f"{shard}: {name} is {f.get_slice(name).get_dtype()}; only "
                                      "float8_e4m3fn block-scaled weights are supported")
            yield name, _Read(f, name, None, scale_file(shard, name, home, config), shard)
        else:
            yield name, _Read(f, name, _dequantizer(f, shard, name, home, config))


def _dequantizer(f: Any, shard: Path, name: str, home: dict[str, Path],
                 config: MLAConfig) -> Callable[[], torch.Tensor]:
    """A float8 weight's dequantized float32 whole, read on first use (what config.json must
    say about it checked now)."""
    scale_file(shard, name, home, config)

    def whole() -> torch.Tensor:
        weight = f.get_tensor(name)
        scale = float8_scale(f, shard, name, weight, home, config)
        return dequantize_weight(weight, scale, config.quantization, f"{shard}: {name}")

    return whole
