"""A chunk's KV rows as one store value: a versioned header, the tokens, the rows, a checksum.

Layout (little-endian)::

    header   HEADER: magic "IRKV", format version, KV dtype, model id, namespace, fingerprint,
             p_source, tokens n, layers, kv_lora_rank, rope dim, checksum
    tokens   int64 [n]                       what a fetch verifies the prompt's chunk against
    c_KV     dtype [layers, n, kv_lora_rank] position-free latent rows
    k_r      dtype [layers, n, rope]         the RoPE key base, rotated to p_source

The checksum (xxh3-64) covers the header (its checksum field zero) and everything after it, so a
truncated, extended or bit-flipped value is refused (:class:`CorruptValue`). A whole, intact
value for something else — another model, another tenant's namespace, another chunk, rows of
other shapes — is refused as :class:`ValueMismatch`. Either way nothing of it is served.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np
import torch
import xxhash

MAGIC = b"IRKV"
VERSION = 1
HEADER = struct.Struct("<4sHBxQQQqIHHH2xQ")  # 60 bytes; the last field is the checksum
_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_CODES = {code: dtype for dtype, code in _DTYPES.items()}


class CorruptValue(ValueError):
    """Not a whole value this format wrote: bad magic, version, length or checksum."""


class ValueMismatch(ValueError):
    """A whole value, but not the one asked for (model, namespace, chunk, tokens or shapes)."""


class Shape(NamedTuple):
    """What a value's rows must be to enter a pool: the model's and the pool's."""

    model_id: int
    layers: int
    rank: int
    rope: int
    dtype: torch.dtype


class Rows(NamedTuple):
    """A registered chunk's rows, as published or fetched."""

    p_source: int
    ckv: torch.Tensor  # [layers, n, rank]
    kr: torch.Tensor  # [layers, n, rope], at p_source


def dtype_code(dtype: torch.dtype) -> int:
    """The header's code of a KV dtype (ValueError for one the format has none for)."""
    if dtype not in _DTYPES:
        raise ValueError(f"no store format for KV dtype {dtype}")
    return _DTYPES[dtype]


def _raw(t: torch.Tensor) -> bytes:
    """A CPU tensor's bytes, whatever its dtype (numpy has no bfloat16: viewed as bytes)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def encode(shape: Shape, namespace: int, fingerprint: int, tokens: bytes, rows: Rows) -> bytes:
    """A value for a chunk: ``tokens`` as int64 bytes, its rows on the CPU in ``shape.dtype``."""
    n = len(tokens) // 8
    expect = (shape.layers, n)
    if rows.ckv.shape != (*expect, shape.rank) or rows.kr.shape != (*expect, shape.rope):
        raise ValueError(f"rows {tuple(rows.ckv.shape)} and {tuple(rows.kr.shape)} do not fit "
                         f"{n} tokens of {shape}")
    body = [tokens, _raw(rows.ckv.to(shape.dtype)), _raw(rows.kr.to(shape.dtype))]
    fields = (MAGIC, VERSION, dtype_code(shape.dtype), shape.model_id, namespace, fingerprint,
              rows.p_source, n, shape.layers, shape.rank, shape.rope)
    digest = xxhash.xxh3_64(HEADER.pack(*fields, 0))
    for part in body:
        digest.update(part)
    return b"".join([HEADER.pack(*fields, digest.intdigest()), *body])


def decode(value: bytes, shape: Shape, namespace: int, fingerprint: int, tokens: bytes) -> Rows:
    """The rows of ``value`` if it is exactly the chunk asked for: ``tokens`` (int64 bytes)
    under this namespace and fingerprint, of this model and these shapes; else
    :class:`CorruptValue` or :class:`ValueMismatch`."""
    if len(value) < HEADER.size:
        raise CorruptValue(f"value of {len(value)} bytes is shorter than a header")
    (magic, version, code, model_id, space, fp, p_source, n, layers, rank, rope,
     checksum) = HEADER.unpack_from(value)
    if magic != MAGIC or version != VERSION:
        raise CorruptValue(f"not a version-{VERSION} value (magic {magic!r}, version {version})")
    dtype = _CODES.get(code)
    if dtype is None:
        raise CorruptValue(f"unknown dtype code {code}")
    element = torch.empty(0, dtype=dtype).element_size()
    size = HEADER.size + 8 * n + layers * n * (rank + rope) * element
    if len(value) != size:
        raise CorruptValue(f"value of {len(value)} bytes, its header says {size}")
    digest = xxhash.xxh3_64(HEADER.pack(magic, version, code, model_id, space, fp, p_source, n,
                                        layers, rank, rope, 0))
    digest.update(memoryview(value)[HEADER.size:])
    if digest.intdigest() != checksum:
        raise CorruptValue("checksum mismatch")
    # Intact: now is it the value asked for? Keys already name model, namespace and chunk;
    # the header says it again, and the tokens are compared one by one, like every local hit.
    if (model_id, space, fp) != (shape.model_id, namespace, fingerprint):
        raise ValueMismatch("value of another model, namespace or chunk")
    if (layers, rank, rope, dtype) != (shape.layers, shape.rank, shape.rope, shape.dtype):
        raise ValueMismatch(f"rows of {layers}x{rank}+{rope} {dtype}, the pool's are "
                            f"{shape.layers}x{shape.rank}+{shape.rope} {shape.dtype}")
    at = HEADER.size
    if value[at:at + 8 * n] != tokens:
        raise ValueMismatch("tokens differ from the prompt's chunk")
    at += 8 * n
    # One copy out of the immutable bytes (torch wants a writable buffer), then views.
    data = torch.from_numpy(np.frombuffer(value, dtype=np.uint8, offset=at).copy())
    split = layers * n * rank * element
    ckv = data[:split].view(dtype).view(layers, n, rank)
    kr = data[split:].view(dtype).view(layers, n, rope)
    return Rows(int(p_source), ckv, kr)
