"""Review regressions: the gate's result cache and the consistency report's reuse subset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from irminsul.quality import result_cache


def _parts(**extra: object) -> dict:
    return {"checkpoint": "ab" * 32, "irminsul": "0", "probes": "cd" * 32, "tokens": 8,
            "device": "cpu", "dtype": "torch.float32", "kernels": False, "shard": None, **extra}


def test_a_tensor_parallel_key_is_found_again(tmp_path: Path) -> None:
    """Under tensor parallel the key holds the model's shard, a tuple (rank, ranks): what was
    saved under it must be read back, not measured again at every start."""
    parts = _parts(shard=(0, 2))
    measurement = [{"name": "p", "kl_pic": 0.001}]
    result_cache.save(tmp_path, parts, measurement)
    assert result_cache.load(tmp_path, parts) == measurement
    # and a different shard is still a different key
    assert result_cache.load(tmp_path, _parts(shard=(1, 2))) is None


@pytest.mark.parametrize("text", ["[]", "null", "3", '"x"', '{"key": 1, "measurement": []}'])
def test_a_cache_file_of_another_shape_counts_as_absent(tmp_path: Path, text: str) -> None:
    """A cache file that parses as JSON but is not the dict save() writes (a hand edit, another
    tool's file) is absent: the gate measures again rather than failing (which a server takes
    as a refusal of live PIC at every start)."""
    parts = _parts()
    path = result_cache.save(tmp_path, parts, [])
    path.write_text(text, "utf-8")
    assert result_cache.load(tmp_path, parts) is None
    json.loads(text)  # it is valid JSON: only its shape is wrong
