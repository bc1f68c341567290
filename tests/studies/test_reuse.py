"""The studies' reuse path: k_r rotated by δ is what a fresh prefill computes at the new
position; the sink study's PIC path equals fresh prefill where rows depend on position only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.tiny_models import build

from irminsul.model import load_model
from irminsul.studies.reuse import joined, moved, prefill
from irminsul.studies.sink import probe, sink_mass


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("tiny")
    build("v2_lite_like", directory, layers=2)
    return load_model(directory)


def test_rotated_k_r_equals_fresh_rows_in_layer_zero(model) -> None:
    """Layer 0's rows depend on the token and its position only, so a row moved by δ must be
    the row computed there; unrotated (naive) it must not."""
    rng = np.random.default_rng(0)
    body = rng.integers(0, 97, 24)
    head_s, head_t = rng.integers(0, 97, 40), rng.integers(0, 97, 75)
    source = prefill(model, body, 40, prefill(model, head_s, 0))
    fresh = prefill(model, body, 75, prefill(model, head_t, 0))
    pic, naive = moved(model, source, 35), moved(model, source, 35, rotate=False)
    torch.testing.assert_close(pic[0], fresh[0], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(naive[0], fresh[0], atol=1e-3)
    rank = model.config.kv_lora_rank
    torch.testing.assert_close(pic[1][:, :rank], source[1][:, :rank])  # c_KV kept as cached
    # Back and forth is the identity.
    torch.testing.assert_close(moved(model, pic, -35)[1], source[1], atol=1e-5, rtol=1e-4)


def test_one_layer_pic_tail_mass_is_fresh(tmp_path) -> None:
    """In a one-layer model every row is position-and-token only: the tail's sink mass under
    PIC equals fresh prefill's; naive reuse differs."""
    build("v2_lite_like", tmp_path, layers=1)
    model = load_model(tmp_path)
    rng = np.random.default_rng(1)
    header, body, tail = (rng.integers(0, 97, n) for n in (50, 30, 10))
    head_rows = prefill(model, header, 0)
    source = prefill(model, body, 70, prefill(model, rng.integers(0, 97, 70), 0))
    fresh = joined(head_rows, prefill(model, body, 50, head_rows))
    pic = joined(head_rows, moved(model, source, -20))
    naive = joined(head_rows, moved(model, source, -20, rotate=False))
    mass = [probe(model, tail, 80, rows, sink_mass)[0] for rows in (fresh, pic, naive)]
    torch.testing.assert_close(mass[1], mass[0], atol=1e-6, rtol=1e-5)
    assert float((mass[2] - mass[0]).abs().max()) > 1e-4
