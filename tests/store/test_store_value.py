"""The value format: what goes in comes out; anything truncated, flipped or meant for another
model, tenant, chunk or pool is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from irminsul.store.value import HEADER, CorruptValue, Rows, Shape, ValueMismatch, decode, encode

SHAPE = Shape(model_id=0x1234, layers=3, rank=8, rope=4, dtype=torch.float32)
NS, FP = 0xAB, 0xCD


def value(n: int = 5, shape: Shape = SHAPE) -> tuple[bytes, bytes, Rows]:
    tokens = np.arange(100, 100 + n, dtype=np.int64).tobytes()
    rows = Rows(40, torch.randn(shape.layers, n, shape.rank).to(shape.dtype),
                torch.randn(shape.layers, n, shape.rope).to(shape.dtype))
    return encode(shape, NS, FP, tokens, rows), tokens, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip(dtype: torch.dtype) -> None:
    shape = SHAPE._replace(dtype=dtype)
    data, tokens, rows = value(shape=shape)
    back = decode(data, shape, NS, FP, tokens)
    assert back.p_source == 40
    assert torch.equal(back.ckv, rows.ckv) and torch.equal(back.kr, rows.kr)
    assert len(data) == HEADER.size + 5 * (8 + 3 * 12 * rows.ckv.element_size())


def test_truncated_extended_or_flipped_values_are_corrupt() -> None:
    data, tokens, _ = value()
    broken = [data[:-1], data[:HEADER.size - 1], data + b"\0", b""]
    for at in (0, 4, 20, HEADER.size - 1, HEADER.size + 3, len(data) // 2, len(data) - 1):
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        broken.append(bytes(flipped))
    for bad in broken:
        with pytest.raises(CorruptValue):
            decode(bad, SHAPE, NS, FP, tokens)


def test_intact_values_of_something_else_are_mismatches() -> None:
    data, tokens, _ = value()
    other_tokens = bytearray(tokens)
    other_tokens[8] ^= 1
    for shape, namespace, fingerprint, content in [
            (SHAPE._replace(model_id=0x1235), NS, FP, tokens),  # another model
            (SHAPE, NS + 1, FP, tokens),  # another tenant
            (SHAPE, NS, FP + 1, tokens),  # another chunk
            (SHAPE, NS, FP, bytes(other_tokens)),  # a fingerprint collision
            (SHAPE._replace(dtype=torch.bfloat16), NS, FP, tokens),  # another pool dtype
            (SHAPE._replace(rank=16), NS, FP, tokens)]:  # another model's shapes
        with pytest.raises(ValueMismatch):
            decode(data, shape, namespace, fingerprint, content)
