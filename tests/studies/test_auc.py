"""The ROC study's AUC against hand-computed cases and a brute-force pairwise count."""

from __future__ import annotations

import numpy as np
import pytest

from irminsul.studies.roc import auc, pairs


def brute_force(positive: np.ndarray, negative: np.ndarray) -> float:
    """Every (positive, negative) pair: 1 if the positive scores higher, ½ if equal."""
    wins = (positive[:, None] > negative[None, :]).sum() + 0.5 * (
        positive[:, None] == negative[None, :]).sum()
    return float(wins / (positive.size * negative.size))


def test_hand_computed() -> None:
    # 0.9 beats both negatives, 0.4 loses to 0.5 and ties 0.4: (1 + 1 + 0 + 0.5) / 4.
    assert auc(np.array([0.9, 0.4]), np.array([0.5, 0.4])) == 0.625
    assert auc(np.array([3.0, 2.0]), np.array([1.0, 0.0])) == 1.0
    assert auc(np.array([0.0]), np.array([1.0, 2.0])) == 0.0
    assert auc(np.array([1.0, 1.0]), np.array([1.0])) == 0.5


@pytest.mark.parametrize("seed", range(5))
def test_rank_formula_equals_pairwise_count(seed: int) -> None:
    rng = np.random.default_rng(seed)
    # Rounded scores give many ties, within and across the classes.
    positive = np.round(rng.normal(0.3, 1.0, 57), 1)
    negative = np.round(rng.normal(0.0, 1.0, 41), 1)
    assert auc(positive, negative) == pytest.approx(brute_force(positive, negative), abs=1e-12)


def test_pairs() -> None:
    positive, negative = pairs(6, 5, np.random.default_rng(0))
    assert positive.shape == negative.shape == (6 * 10, 4)
    assert (positive[:, 0] == positive[:, 2]).all() and (positive[:, 1] < positive[:, 3]).all()
    assert (negative[:, 0] != negative[:, 2]).all()  # different content
    assert set(negative[:, 1]) | set(negative[:, 3]) == set(range(5))  # random slots


def test_auc_needs_both_classes() -> None:
    with pytest.raises(ValueError):
        auc(np.array([]), np.array([1.0]))
