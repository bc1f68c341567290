"""tools/default_model/attention_heads.py against attention maps built by hand: a head on
position 0, a head on its own token, a uniform head, with the shares worked out in closed form."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "default_model"))

import attention_heads  # noqa: E402

N, FIRST = 40, 20


class HandBuilt:
    """A 'model' whose one layer has three heads: all weight on key 0, all on the query's own
    key, and uniform over the visible keys."""

    def __call__(self, input_ids: torch.Tensor, output_attentions: bool) -> SimpleNamespace:
        n = input_ids.shape[1]
        causal = torch.tril(torch.ones(n, n))
        a = torch.zeros(1, 3, n, n)
        a[0, 0, :, 0] = 1.0
        a[0, 1] = torch.eye(n)
        a[0, 2] = causal / causal.sum(-1, keepdim=True)
        return SimpleNamespace(attentions=(a,))


def test_shares_match_closed_form() -> None:
    prompts = [np.arange(N), np.arange(N) + 1]
    got = attention_heads.head_shares(HandBuilt(), prompts, FIRST)
    q = np.arange(FIRST, N) + 1  # visible keys per query
    uniform0 = float(np.mean(1 / q))
    assert got["uniform_position0"] == pytest.approx(uniform0)
    assert got["position0"][0] == pytest.approx([1.0, 0.0, uniform0], abs=1e-4)
    local = attention_heads.LOCAL
    assert got["local"][0] == pytest.approx([0.0, 1.0, float(np.mean(local / q))], abs=1e-3)
    assert got["top1"][0] == pytest.approx([1.0, 1.0, uniform0], abs=1e-3)
    # The uniform head's position-0 share is exactly uniform: 1x, not a sink; the local head is.
    assert got["sink_heads_per_layer"] == [1]
    assert got["local_heads_per_layer"] == [1]


def test_windows_open_at_long_documents(tmp_path: Path) -> None:
    tokens = np.arange(100, dtype=np.uint16)
    tokens.tofile(tmp_path / "val.bin")
    np.save(tmp_path / "val.starts.npy", np.array([0, 10, 50, 90]))  # lengths 10, 40, 40, 10
    windows = attention_heads.doc_windows(tmp_path, 30, 5)
    assert [int(w[0]) for w in windows] == [10, 50]
    assert all(w.size == 30 for w in windows)
