"""A checkpoint's hash: what the gate's results are cached by.

SHA-256 over config.json's bytes and, for each safetensors weight file the loader reads (in its
order): the file's name, size and safetensors header (every tensor's name, dtype, shape and
offsets), and its data: whole for files up to ``WHOLE_BYTES``, else ``SAMPLES`` blocks of
``BLOCK_BYTES`` evenly spaced through it. Cheap at any size (about 4 MiB read per large shard:
a few seconds for a 700 GB checkpoint, well under a second for the embedded model, which is
hashed whole), and it changes with anything that changes what the model computes: its config,
its shapes or dtypes, and its weights wherever a fine-tune changes them. An edit confined to a
few weights of a large shard can fall between the sampled blocks; ``irminsul gate --fresh``
measures again whatever the cache holds.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

from ..model.loader import checkpoint_shards as weight_files  # the loader's files, its order

WHOLE_BYTES = 64 << 20  # files up to this size are hashed whole
SAMPLES, BLOCK_BYTES = 64, 64 << 10  # larger files: this many blocks of this size


def checkpoint_hash(model_dir: str | os.PathLike, *, whole_bytes: int = WHOLE_BYTES) -> str:
    """The hex SHA-256 of a checkpoint directory (see the module's docstring)."""
    path = Path(model_dir)
    digest = hashlib.sha256()
    config = (path / "config.json").read_bytes()
    digest.update(b"config.json\0%d\0" % len(config) + config)
    for weights in weight_files(path):
        size = weights.stat().st_size
        digest.update(b"%s\0%d\0" % (weights.name.encode(), size))
        with open(weights, "rb") as f:
            if size <= whole_bytes:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
                continue
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(header_len))
            start = 8 + header_len
            span = max(size - start - BLOCK_BYTES, 0)
            for i in range(SAMPLES):
                f.seek(start + span * i // max(SAMPLES - 1, 1))
                digest.update(f.read(BLOCK_BYTES))
    return digest.hexdigest()
