"""The gate's verdict on given figures: each threshold refuses on its own, in its order, and
NaN or an empty measurement never passes."""

from __future__ import annotations

import dataclasses
import math

import pytest

from irminsul.config import GateConfig
from irminsul.quality import ProbeResult, judge

CONFIG = GateConfig(max_kl=0.02, min_argmax=0.9)


def probe(kl_pic: float = 1e-3, kl_naive: float = 0.5, argmax: float = 1.0,
          pic_tokens: int = 300) -> ProbeResult:
    return ProbeResult("p", "moved_document", 600, pic_tokens, kl_pic, kl_naive, argmax, 0.75,
                       8, 2)


def test_figures_are_means_over_the_probes_pic_served() -> None:
    result = judge("c", (probe(1e-3, 0.2, 1.0), probe(3e-3, 0.4, 0.875),
                         probe(9.0, 9.0, 0.0, pic_tokens=0)), CONFIG)
    assert result.passed and result.checkpoint == "c" and not result.cached
    assert result.kl_pic == pytest.approx(2e-3) and result.kl_naive == pytest.approx(0.3)
    assert result.argmax == pytest.approx(0.9375) and result.first_divergence == 8
    assert len(result.probes) == 3 and result.tokens == CONFIG.tokens


@pytest.mark.parametrize(("probes", "words"), [
    ((probe(kl_pic=0.03, kl_naive=0.5),), "exceeds the threshold 0.02"),
    ((probe(kl_pic=0.01, kl_naive=0.01),), "not below naive reuse's"),
    ((probe(kl_pic=0.01, kl_naive=0.005),), "not below naive reuse's"),
    ((probe(argmax=0.875),), "below 0.9"),
    ((probe(kl_pic=math.nan),), "exceeds the threshold"),
    ((probe(kl_naive=math.nan),), "not below naive"),
    ((probe(pic_tokens=0),), "PIC served none of the 1 probes"),
    ((), "PIC served none of the 0 probes"),
])
def test_refusals(probes: tuple[ProbeResult, ...], words: str) -> None:
    result = judge("c", probes, CONFIG)
    assert not result.passed and words in result.reason


def test_a_second_turn_served_only_a_derived_prefix_counts() -> None:
    """A follow-up that PIC served nothing from the registry but its first turn's reused rows
    (a derived prefix) measured reuse: its figures enter the means, and alone it is judged."""
    second = dataclasses.replace(probe(kl_pic=0.03, kl_naive=0.5, pic_tokens=0),
                                 kind="second_turn", derived_tokens=400)
    result = judge("c", (probe(1e-3, 0.2, 1.0), second), CONFIG)
    assert result.kl_pic == pytest.approx(0.0155) and result.kl_naive == pytest.approx(0.35)
    alone = judge("c", (second,), CONFIG)
    assert not alone.passed and "exceeds the threshold 0.02" in alone.reason
    # Without the derived rows it measured nothing, and is left out of the means.
    nothing = dataclasses.replace(second, derived_tokens=0)
    assert judge("c", (probe(1e-3, 0.2, 1.0), nothing), CONFIG).kl_pic == pytest.approx(1e-3)


def test_the_kl_threshold_is_checked_before_below_naive() -> None:
    result = judge("c", (probe(kl_pic=0.05, kl_naive=0.01),), CONFIG)
    assert "exceeds the threshold" in result.reason


def test_below_naive_can_be_turned_off() -> None:
    figures = (probe(kl_pic=0.01, kl_naive=0.005),)
    assert judge("c", figures, GateConfig(below_naive=False)).passed


def test_to_json_writes_nan_as_null() -> None:
    data = judge("c", (), CONFIG).to_json()
    assert data["kl_pic"] is None and data["passed"] is False and data["probes"] == ()


@pytest.mark.parametrize("bad", [{"max_kl": -1.0}, {"max_kl": math.nan}, {"min_argmax": 1.5},
                                 {"tokens": 0}])
def test_config_is_checked(bad: dict) -> None:
    with pytest.raises(ValueError):
        GateConfig(**bad)
