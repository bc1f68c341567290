"""Load a Hugging Face checkpoint directory (config.json + safetensors) into :class:`MLAModel`.

Single-file or sharded (``model.safetensors.index.json``) safetensors, bf16/fp16/fp32, and FP8
block-quantized weights (``X.weight`` float8_e4m3fn with ``X.weight_scale_inv``), dequantized
on load — or, with ``keep_fp8``, kept float8 in :class:`~irminsul.model.fp8.FP8Linear` modules.
Tensors of multi-token-prediction layers (index >= num_hidden_layers) are skipped. A missing,
unexpected or mis-shaped tensor is an error naming it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from .config import MLAConfig, QuantConfig, load_config
from .fp8 import FP8Linear, dequantize_blocks, scale_grid
from .model import MLAModel
from .rope import audit_rotary

log = logging.getLogger(__name__)

FP32_PARAMS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # routers stay float32
FLOAT8_DTYPES = tuple(getattr(torch, name) for name in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name))
# Linears whose float8 weights keep_fp8 still dequantizes at load, because code outside their
# forward reads ``.weight`` as a dense matrix: kv_b_proj (split into W_UK / W_UV by the absorbed
# attention; 2% of a V3 layer's weights). The routed experts are kept: MoE.fuse stacks their
# float8 weights and scales.
DENSE_ONLY = (".self_attn.kv_b_proj.",)


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match what its config.json describes."""


def checkpoint_shards(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's shards, or the single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text("utf-8")).get("weight_map", {})
        shards = [path / name for name in sorted(set(weight_map.values()))]
        absent = [shard.name for shard in shards if not shard.is_file()]
        if absent:
            raise CheckpointError(f"{index}: shard file(s) listed in the index are missing: "
                                  f"{', '.join(absent)}")
        return shards
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def used_tensors(path: str | os.PathLike, config: MLAConfig
                 ) -> Iterator[tuple[Path, Any, str, dict[str, Path]]]:
    """(file, its open safetensors handle, tensor name, every tensor's file) for each tensor the
    model uses: multi-token-prediction layers (not used for decoding) and ``weight_scale_inv``
    tensors (read with their weights) skipped. The handle is open while the item is held."""
    shards = checkpoint_shards(Path(path))
    home = tensor_homes(shards)
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                layer = layer_index(name)
                if layer is not None and layer >= config.num_hidden_layers:
                    continue
                if name.endswith(".weight_scale_inv"):
                    continue
                dtype = f.get_slice(name).get_dtype()
                if not dtype.startswith(("F", "BF")):  # F16, F32, BF16, F8_*; not I*, U*, BOOL
                    raise CheckpointError(f"{shard}: tensor {name} is {dtype}; the model's "
                                          "weights must be floating point")
                yield shard, f, name, home


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor belongs to (``model.layers.{i}.…``), or None."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def tensor_homes(shards: list[Path]) -> dict[str, Path]:
    """Tensor name → the file holding it (a weight's scale may sit in another file)."""
    home: dict[str, Path] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                home.setdefault(name, shard)
    return home


def _check_scale(weight: torch.Tensor, scale_inv: torch.Tensor, quant: QuantConfig,
                 name: str = "weight") -> None:
    """``scale_inv`` must be exactly [ceil(M / block_rows), ceil(N / block_cols)]: a scale grid of
    another shape (a block size in config.json that is not the one the checkpoint was quantized
    with, a truncated tensor) would otherwise be silently cropped or broadcast into wrong weights.
    """
    rows, cols = quant.block
    if weight.dim() != 2:
        raise CheckpointError(f"{name} is float8 but {weight.dim()}-D; expected a 2-D weight")
    expected = scale_grid(weight.shape, quant.block)
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(f"{name}_scale_inv has shape {tuple(scale_inv.shape)}, but {name} "
                              f"{tuple(weight.shape)} with weight_block_size [{rows}, {cols}] "
                              f"needs {expected}")


def dequantize_weight(weight: torch.Tensor, scale_inv: torch.Tensor, quant: QuantConfig,
                      name: str = "weight") -> torch.Tensor:
    """W[m, n] = float(Wq[m, n]) * scale_inv[m // block_rows, n // block_cols], float32, after
    :func:`_check_scale`."""
    _check_scale(weight, scale_inv, quant, name)
    return dequantize_blocks(weight, scale_inv, quant.block)


def float8_names(path: str | os.PathLike, config: MLAConfig) -> set[str]:
    """The checkpoint's float8 tensors outside MTP layers, from the shard headers (no data read)."""
    names = set()
    for shard in checkpoint_shards(Path(path)):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                layer = layer_index(name)
                if ((layer is None or layer < config.num_hidden_layers)
                        and f.get_slice(name).get_dtype().startswith("F8")):
                    names.add(name)
    return names


def keep_float8_linears(model: MLAModel, float8: set[str],
                        quant: QuantConfig | None) -> set[str]:
    """Swap each nn.Linear of ``model`` whose checkpoint weight is float8 (but not those of
    :data:`DENSE_ONLY`) for an :class:`FP8Linear`; the weight names now to be loaded as float8.

    Without a quantization config nothing is swapped: :func:`read_tensors` refuses the float8
    tensors then, with the message it gives without ``keep_fp8``."""
    kept: set[str] = set()
    if quant is None:
        return kept
    for weight in sorted(float8):
        module_name = weight.removesuffix(".weight")
        if module_name == weight or any(part in weight for part in DENSE_ONLY):
            continue
        try:
            linear = model.get_submodule(module_name)
        except AttributeError:
            continue  # not a module of the model: the usual "unexpected tensor" error follows
        if type(linear) is not nn.Linear:
            continue
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                FP8Linear.like(linear, quant.block))
        kept.add(weight)
    return kept


def scale_file(shard: Path, name: str, home: dict[str, Path], config: MLAConfig) -> Path:
    """The file holding float8 weight ``name``'s ``weight_scale_inv`` (``home``: every
    tensor's file), after checking config.json says how to use it."""
    if config.quantization is None:
        raise CheckpointError(f"{shard}: {name} is float8 but config.json has no "
                              "quantization_config")
    scale_shard = home.get(name + "_scale_inv")
    if scale_shard is None:
        raise CheckpointError(f"{shard}: {name} is float8 without {name}_scale_inv")
    return scale_shard


def float8_scale(f: Any, shard: Path, name: str, tensor: torch.Tensor, home: dict[str, Path],
                 config: MLAConfig) -> torch.Tensor:
    """The ``weight_scale_inv`` of the float8 weight ``tensor`` (``name`` in ``shard``, open as
    ``f``), read from whichever file holds it; only float8_e4m3fn block-scaled weights pass."""
    if tensor.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{shard}: {name} is {tensor.dtype}; only float8_e4m3fn "
                              "block-scaled weights are supported")
    scale_shard = scale_file(shard, name, home, config)
    if scale_shard == shard:
        return f.get_tensor(name + "_scale_inv")
    with safe_open(str(scale_shard), framework="pt") as g:
        return g.get_tensor(name + "_scale_inv")


def read_tensors(path: str | os.PathLike, config: MLAConfig,
                 keep: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor the model uses, MTP layers skipped, FP8 dequantized —
    except the float8 weights named in ``keep``, given as they are and followed by their
    ``weight_scale_inv`` (float32, shape checked)."""
    for shard, f, name, home in used_tensors(path, config):
        tensor = f.get_tensor(name)
        if tensor.dtype in FLOAT8_DTYPES:
            scale = float8_scale(f, shard, name, tensor, home, config)
            if name in keep:
                _check_scale(tensor, scale, config.quantization, f"{shard}: {name}")
                yield name, tensor
                yield name + "_scale_inv", scale.float()
                continue
            tensor = dequantize_weight(tensor, scale, config.quantization, f"{shard}: {name}")
        yield name, tensor


def load_model(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", keep_fp8: bool = False) -> MLAModel:
    """Build the model from ``path``/config.json and load its safetensors weights.

    ``keep_fp8``: an FP8 checkpoint's linear weights stay float8_e4m3fn with their block scales in
    :class:`FP8Linear` modules (half of bf16's bytes), dequantized per forward; the routed
    experts stay float8 in the MoE's stacked ``w13`` / ``w2`` (read as float8 by the fused
    kernel); kv_b_proj is still dequantized at load (:data:`DENSE_ONLY`). Logits equal the
    dequantize-at-load model's. A checkpoint without float8 weights loads as without it.
    """
    config = load_config(path)
    with torch.device("meta"):
        model = MLAModel(config)
    kept = (keep_float8_linears(model, float8_names(path, config), config.quantization)
            if keep_fp8 else set())
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in read_tensors(path, config, kept):
        if name not in expected:
            raise CheckpointError(f"{path}: unexpected tensor {name} {tuple(tensor.shape)}")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, "
                                  f"config.json implies {expected[name]}")
        if name in kept:
            target = tensor.dtype  # float8 as stored
        elif name.endswith(FP32_PARAMS) or name.endswith(".weight_scale_inv"):
            target = torch.float32
        else:
            target = dtype
        state[name] = tensor.to(device=device, dtype=target)
    install(model, state, expected, path)
    model.fuse_experts()
    audit_rotary(model.rotary, config)
    return model.eval()


def missing_tensors(path: str | os.PathLike, names: set[str]) -> CheckpointError:
    """The error for a checkpoint that lacks tensors ``names`` (the first five named)."""
    missing = sorted(names)
    more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
    return CheckpointError(f"{path}: missing tensors {', '.join(missing[:5])}{more}")


def install(model: MLAModel, state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
            path: str | os.PathLike) -> None:
    """Put the read tensors ``state`` into ``model`` (built on the meta device), refusing with
    the missing tensors' names if any of ``expected`` was not read; tied embeddings re-tied."""
    missing = set(expected) - set(state)
    if missing:
        raise missing_tensors(path, missing)
    tied = model.config.tie_word_embeddings
    model.load_state_dict(state, strict=not tied, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
