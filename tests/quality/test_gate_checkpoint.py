"""checkpoint_hash: the bytes that decide what a checkpoint computes, never its path; large
weight files by header, size and sampled blocks."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from irminsul.quality import checkpoint_hash
from irminsul.quality.checkpoint import BLOCK_BYTES, SAMPLES


def write_checkpoint(directory: Path, data: bytes, header: dict | None = None) -> Path:
    """A directory with a config.json and a model.safetensors of ``data`` behind ``header``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "deepseek_v2"}))
    head = json.dumps(header or {"w": {"dtype": "U8", "shape": [len(data)],
                                       "data_offsets": [0, len(data)]}}).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + data)
    return directory


def test_a_small_checkpoint_is_hashed_whole(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "a", bytes(range(256)) * 64)
    config = (directory / "config.json").read_bytes()
    weights = (directory / "model.safetensors").read_bytes()
    expected = hashlib.sha256(b"config.json\0%d\0" % len(config) + config
                              + b"model.safetensors\0%d\0" % len(weights) + weights).hexdigest()
    assert checkpoint_hash(directory) == expected


def test_the_path_does_not_count_but_every_byte_does(tmp_path: Path) -> None:
    data = bytearray(range(256)) * 64
    a = checkpoint_hash(write_checkpoint(tmp_path / "a", bytes(data)))
    assert checkpoint_hash(write_checkpoint(tmp_path / "b", bytes(data))) == a
    data[5000] ^= 1
    assert checkpoint_hash(write_checkpoint(tmp_path / "c", bytes(data))) != a
    changed = write_checkpoint(tmp_path / "d", bytes(range(256)) * 64)
    (changed / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert checkpoint_hash(changed) != a


def test_a_large_file_is_hashed_by_header_size_and_sampled_blocks(tmp_path: Path) -> None:
    size = SAMPLES * BLOCK_BYTES * 4  # the samples cover a quarter of it
    data = bytearray(size)

    def hashed(name: str, **kw) -> str:
        return checkpoint_hash(write_checkpoint(tmp_path / name, bytes(data), **kw),
                               whole_bytes=0)

    base = hashed("base")
    data[0] = 1  # inside the first sampled block
    first = hashed("first")
    data[-1] = 1  # inside the last
    last = hashed("last")
    data[BLOCK_BYTES + 10] = 1  # between the first two samples: not read
    between = hashed("between")
    assert len({base, first, last}) == 3 and between == last
    header = {"w": {"dtype": "I8", "shape": [size], "data_offsets": [0, size]}}
    assert hashed("header", header=header) != last


def test_a_checkpoint_without_weights_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no model.safetensors"):
        checkpoint_hash(tmp_path)
