"""Store keys, and the model identity they carry.

A key names the model, the namespace and the chunk::

    irminsul:kv1:<model id>:<namespace>:<fingerprint>        (hex, 16 digits each)

The namespace is the engine's (the served model name and the tenant's ``cache_salt``, seeded
into every fingerprint), so a tenant's lookups can only address its own values; the model id
keeps two models served under one name apart, and a bfloat16 engine from a float32 one.
"""

from __future__ import annotations

import dataclasses
import json

import torch
import xxhash

from ..model import MLAModel
from ..parallel.shard import split_dims
from .value import VERSION

SAMPLE = 4096  # elements of each weight tensor the identity hashes, evenly spaced
LARGEST_WORLD = 8  # tensor-parallel sizes up to this give one model one identity (a host's GPUs)


def model_identity(model: MLAModel, kv_dtype: torch.dtype) -> int:
    """A 64-bit identity of a model's KV rows: its config, the KV dtype, and an evenly spaced
    sample of every weight (names, shapes, dtypes and ``SAMPLE`` values each). Two checkpoints
    that differ anywhere a fine-tune changes weights differ here; one where only a handful of
    weights differ might not (give ``StoreConfig.model_id`` then). Cheap at any size: the
    samples are gathered on the weights' device and read back once.

    The same under tensor parallel at any world size up to ``LARGEST_WORLD`` (rank 0 computes
    it from its share): the config and shapes are the whole model's, and a weight that tensor
    parallel splits is sampled from its leading ``1/LARGEST_WORLD`` along the split, which
    rank 0 holds whatever the split. So engines serving one checkpoint at different sizes
    share the store."""
    world = model.shard[1] if model.shard is not None else 1
    if world > 1 and model.attention_mode != "tensor":
        # Each data-parallel rank holds other experts: their samples would differ by rank.
        raise ValueError("the store's model identity is computed from the whole model or a "
                         "tensor-parallel share, not a data-parallel one: give "
                         "StoreConfig.model_id")
    if world > LARGEST_WORLD:
        raise ValueError(f"the store's model identity covers tensor-parallel sizes up to "
                         f"{LARGEST_WORLD}, not {world}: give StoreConfig.model_id")
    config = dataclasses.replace(model.config,
                                 num_attention_heads=model.config.num_attention_heads * world)
    digest = xxhash.xxh3_64(json.dumps(dataclasses.asdict(config), sort_keys=True,
                                       default=str).encode())
    digest.update(str(kv_dtype).encode())
    dims = split_dims(model)
    samples = []
    for name, tensor in sorted(model.state_dict().items()):
        shape = list(tensor.shape)
        if name in dims:
            dim = dims[name]
            shape[dim] *= world
            tensor = tensor.narrow(dim, 0, shape[dim] // LARGEST_WORLD)
        digest.update(f"{name}:{tuple(shape)}:{tensor.dtype};".encode())
        flat = tensor.detach().reshape(-1)
        if flat.numel():
            step = max(1, flat.numel() // SAMPLE)
            samples.append(flat[::step][:SAMPLE].to(torch.float32))
    if samples:
        digest.update(torch.cat(samples).cpu().numpy().tobytes())
    return digest.intdigest()


def parse_model_id(text: str) -> int:
    """An operator's ``model_id`` (any string) as the 64-bit id keys carry."""
    return xxhash.xxh3_64_intdigest(text.encode())


def key(model_id: int, namespace: int, fingerprint: int) -> str:
    """The store key of a chunk of one model, in one namespace."""
    return f"irminsul:kv{VERSION}:{model_id:016x}:{namespace:016x}:{fingerprint:016x}"
