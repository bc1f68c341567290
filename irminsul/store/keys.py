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
from .value import VERSION

SAMPLE = 4096  # elements of each weight tensor the identity hashes, evenly spaced


def model_identity(model: MLAModel, kv_dtype: torch.dtype) -> int:
    """A 64-bit identity of a model's KV rows: its config, the KV dtype, and an evenly spaced
    sample of every weight (names, shapes, dtypes and ``SAMPLE`` values each). Two checkpoints
    that differ anywhere a fine-tune changes weights differ here; one where only a handful of
    weights differ might not (give ``StoreConfig.model_id`` then). Cheap at any size: the
    samples are gathered on the weights' device and read back once."""
    digest = xxhash.xxh3_64(json.dumps(dataclasses.asdict(model.config), sort_keys=True,
                                       default=str).encode())
    digest.update(str(kv_dtype).encode())
    samples = []
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
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
