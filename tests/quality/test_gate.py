"""The PIC correctness gate on real checkpoints: the embedded default model passes; a runner whose
rotation does not match the model's rope, and a checkpoint on which reuse itself is unsafe, are
refused; results are read from the cache per checkpoint hash, and measured again when the
checkpoint changes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gate_checkpoints import copy_default, gate_of, make_unsafe

from irminsul.cli import main
from irminsul.config import EngineConfig, GateConfig
from irminsul.engine import Engine, ModelRunner
from irminsul.engine.batch import Reuse
from irminsul.model import MLAModel, load_model
from irminsul.model.default import default_model_dir
from irminsul.quality import GateResult, gate_probes, judge
from irminsul.quality import gate as gate_module
from irminsul.traffic.prompt import Prompt, render_prompt
from irminsul.traffic.render import ChatRenderer


class WrongSignRunner(ModelRunner):
    """Rotates reused k_r by −δ instead of δ: a rotation that does not match the model's rope,
    while full recomputation stays the model's own."""

    def rotate(self, reuse: Reuse) -> None:
        super().rotate(Reuse(reuse.src, reuse.dst, -reuse.deltas))


def greedy_by_whole_forwards(model: MLAModel, prompt: Prompt, tokens: int
                             ) -> tuple[list[int], torch.Tensor]:
    """The reference, independent of the engine: ``prompt``'s greedy continuation of ``tokens``
    tokens, each step a full forward from position 0, and the logits predicting each token."""
    ids = torch.from_numpy(prompt.tokens.astype(np.int64))
    continuation: list[int] = []
    for _ in range(tokens):
        step = torch.cat([ids, torch.tensor(continuation, dtype=torch.int64)])
        continuation.append(int(model.logits(step)[-1].argmax()))
    whole = torch.cat([ids, torch.tensor(continuation[:-1], dtype=torch.int64)])
    return continuation, model.logits(whole)[prompt.size - 1:]


def kl_per_token(served: torch.Tensor, full: torch.Tensor) -> float:
    """Mean KL(full || served) per step, by torch's kl_div in float64."""
    return float(torch.nn.functional.kl_div(
        torch.log_softmax(served.double(), -1), torch.log_softmax(full.double(), -1),
        log_target=True, reduction="none").sum(-1).mean())


def test_the_default_model_passes(default_result: GateResult, gate_config: GateConfig) -> None:
    r = default_result
    assert r.passed, r.reason
    probes = gate_probes()
    assert not r.cached and len(r.probes) == len(probes) + sum(
        p.follow_up is not None for p in probes)
    assert 0 <= r.kl_pic <= gate_config.max_kl and r.argmax >= gate_config.min_argmax
    # The rotation is what makes reuse safe here: naive reuse is far worse on the same probes.
    assert r.kl_naive > 10 * r.kl_pic and r.argmax_naive < r.argmax
    assert r.first_divergence >= r.first_divergence_naive
    assert r.thresholds == {"max_kl": gate_config.max_kl, "below_naive": True,
                            "min_argmax": gate_config.min_argmax}


def test_every_probe_is_served_by_pic_past_the_carve_out(default_result: GateResult) -> None:
    # A probe PIC serves nothing of measures nothing. Reuse starts at or past the carve-out
    # (position 32) by construction, so every token counted here is position-independent reuse.
    for probe in default_result.probes:
        if probe.kind == "second_turn":  # served through its first turn's rows
            continue
        assert probe.pic_tokens >= 128, probe
        assert probe.pic_tokens < probe.prompt_tokens


def test_a_second_turn_is_served_its_first_turns_reused_rows(default_result: GateResult,
                                                            gate_config: GateConfig) -> None:
    """Each follow-up is served its moved request's rows from the first reused position on as
    a derived prefix (never as exact prefix). Gated on its own probe (fresh engines: only that
    probe's turns cached), its figures match an independent computation: the reference by whole
    forwards from position 0, the served logits from a fresh engine that served the probe's two
    earlier turns, KL by torch's kl_div."""
    model_dir = default_model_dir()
    model, renderer = load_model(model_dir), ChatRenderer.from_dir(model_dir)
    tokens = default_result.tokens
    in_set = {p.name: p for p in default_result.probes}
    probes = [p for p in gate_probes() if p.follow_up is not None]
    assert len(probes) == 2
    for probe in probes:
        assert in_set[f"{probe.name}, second turn"].derived_tokens >= 128
        alone = gate_of(model_dir, gate_config, probes=[probe])
        first, second = alone.probes
        assert second.name == f"{probe.name}, second turn" and second.kind == "second_turn"
        seen, moved, follow = (render_prompt(renderer, r.messages, r.tools)
                               for r in (probe.seen, probe.moved, probe.follow_up))
        assert second.prompt_tokens == follow.size and second.derived_tokens >= 128
        # The derived stretch starts where moved's first reused row does, or before it.
        assert second.derived_tokens >= first.pic_tokens

        # The fresh engine serves the earlier turns as the gate does: seen, then moved with its
        # reference continuation teacher-forced (its rows are cached with moved's).
        engine = Engine(model, EngineConfig(mode="live", slots=8192))
        seq, _ = engine.prefill(seen.tokens, seen.resets)
        engine.finish(seq)
        seq, _ = engine.prefill(moved.tokens, moved.resets)
        engine.extend(seq, greedy_by_whole_forwards(model, moved, tokens)[0][:-1])
        engine.finish(seq)
        continuation, full = greedy_by_whole_forwards(model, follow, tokens)
        seq, first_logits = engine.prefill(follow.tokens, follow.resets)
        assert seq.stats.derived_prefix_tokens == second.derived_tokens
        served = torch.cat([first_logits[None], engine.extend(seq, continuation[:-1])])
        assert second.kl_pic == pytest.approx(kl_per_token(served, full), rel=1e-2, abs=1e-7)
        assert second.kl_naive > second.kl_pic  # naive reuse's error is inherited too


def test_a_probes_figures_match_an_independent_computation(default_result: GateResult) -> None:
    """The first probe (fresh engines: only its own seen request is cached) recomputed with
    other primitives: the reference continuation by whole forwards from position 0, PIC's
    logits from a fresh engine, KL by torch's kl_div."""
    model_dir = default_model_dir()
    model, renderer = load_model(model_dir), ChatRenderer.from_dir(model_dir)
    probe, tokens = gate_probes()[0], default_result.tokens
    seen, moved = (render_prompt(renderer, r.messages, r.tools) for r in (probe.seen, probe.moved))
    continuation, full = greedy_by_whole_forwards(model, moved, tokens)
    engine = Engine(model, EngineConfig(mode="live", slots=4096))
    seq, _ = engine.prefill(seen.tokens, seen.resets)
    engine.finish(seq)
    seq, first = engine.prefill(moved.tokens, moved.resets)
    pic = torch.cat([first[None], engine.extend(seq, continuation[:-1])])
    measured = default_result.probes[0]
    assert measured.name == probe.name and measured.pic_tokens == seq.stats.pic_tokens > 0
    assert measured.kl_pic == pytest.approx(kl_per_token(pic, full), rel=1e-2, abs=1e-7)
    matches = (pic.argmax(-1) == torch.tensor(continuation)).double().mean()
    assert measured.argmax_pic == pytest.approx(float(matches))


def test_a_rotation_that_does_not_match_the_rope_is_refused(gate_config: GateConfig) -> None:
    # One probe (a compacted tool result: reused turns moved back, δ < 0) keeps it quick.
    probes = [gate_probes()[4]]
    wrong = gate_of(default_model_dir(), gate_config, runner=WrongSignRunner, probes=probes)
    assert not wrong.passed and "exceeds the threshold" in wrong.reason
    assert wrong.kl_pic > gate_config.max_kl
    assert wrong.kl_pic > wrong.kl_naive  # rotating by −δ is worse than not rotating at all
    # Below-naive refuses it on its own, with the KL threshold out of the way...
    lenient = dataclasses.replace(gate_config, max_kl=1e6)
    verdict = judge(wrong.checkpoint, wrong.probes, lenient)
    assert not verdict.passed and "not below naive" in verdict.reason
    # ...and without that check the same figures pass: each threshold does its own work.
    assert judge(wrong.checkpoint, wrong.probes,
                 dataclasses.replace(lenient, below_naive=False, min_argmax=0.0)).passed


def test_a_cached_result_is_read_not_measured(default_result: GateResult,
                                              gate_config: GateConfig, measurements,
                                              forwards) -> None:
    again = gate_of(default_model_dir(), gate_config)
    assert (measurements(), forwards()) == (0, 0)
    assert again.cached and again.passed and again.probes == default_result.probes
    # A stricter threshold is applied to the cached figures, still without a forward.
    strict = gate_of(default_model_dir(),
                     dataclasses.replace(gate_config, max_kl=default_result.kl_pic / 2))
    assert not strict.passed and "exceeds the threshold" in strict.reason
    assert (measurements(), forwards()) == (0, 0)


def test_fresh_measures_again(default_result: GateResult, gate_config: GateConfig,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    # The measurement itself stubbed out (it is what the other tests measure): only whether
    # the gate asks for one counts here.
    calls = []
    monkeypatch.setattr(gate_module, "measure",
                        lambda *args, **kwargs: calls.append(1) or default_result.probes)
    for fresh in (False, True, False):
        result = gate_of(default_model_dir(), gate_config, fresh=fresh)
        assert result.cached is not fresh and result.passed
    assert len(calls) == 1


def test_a_changed_checkpoint_is_measured_again_and_refused(
        tmp_path: Path, default_result: GateResult, gate_config: GateConfig,
        measurements) -> None:
    copy = copy_default(tmp_path / "copy")
    # The hash is of the bytes, not the path: a copy is the same checkpoint.
    same = gate_of(copy, gate_config)
    assert same.cached and same.checkpoint == default_result.checkpoint and measurements() == 0
    make_unsafe(copy)
    changed = gate_of(copy, gate_config)
    assert measurements() == 1 and not changed.cached
    assert changed.checkpoint != default_result.checkpoint
    assert not changed.passed and "exceeds the threshold" in changed.reason


def test_a_checkpoint_where_reuse_is_unsafe_is_refused(unsafe_dir: Path,
                                                       gate_config: GateConfig) -> None:
    result = gate_of(unsafe_dir, gate_config)
    assert not result.passed and result.kl_pic > gate_config.max_kl
    # The rotation is right (PIC is still better than naive reuse); the reused rows themselves
    # are too far from what full recomputation computes on this checkpoint.
    assert result.kl_pic < result.kl_naive


def test_cli_passes_the_default_model(default_result: GateResult, gate_config: GateConfig,
                                      tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "gate.json"
    assert main(["gate", "--cache-dir", gate_config.cache_dir, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "PASS: KL(full||PIC)" in text and "cached result" in text
    for probe in default_result.probes:
        assert probe.name in text
    data = json.loads(out.read_text())
    assert data["passed"] and data["checkpoint"] == default_result.checkpoint
    assert data["kl_pic"] == pytest.approx(default_result.kl_pic)
    assert [p["name"] for p in data["probes"]] == [p.name for p in default_result.probes]


def test_cli_refuses_the_unsafe_checkpoint(unsafe_dir: Path, gate_config: GateConfig,
                                           capsys: pytest.CaptureFixture) -> None:
    assert main(["gate", "--model", str(unsafe_dir), "--cache-dir", gate_config.cache_dir]) == 1
    assert "REFUSED: KL(full||PIC)" in capsys.readouterr().out


def test_cli_gate_takes_no_tokenizer(capsys: pytest.CaptureFixture) -> None:
    assert main(["--tokenizer", "elsewhere", "gate"]) == 2
    assert "--tokenizer does not apply" in capsys.readouterr().err


def test_cli_gate_measures_with_the_repair_it_is_given(monkeypatch: pytest.MonkeyPatch,
                                                       default_result: GateResult,
                                                       gate_config: GateConfig) -> None:
    """--recompute-head / --recompute-share / --recompute-rule / --recompute-check-layer /
    --no-sub-windows reach the engine the gate measures (and so its cache key), as they reach
    the served engine; a bad value is refused before anything runs."""
    seen: list[EngineConfig] = []

    def fake_run_gate(model, renderer, checkpoint, config, *, engine, fresh):  # noqa: ANN001
        seen.append(engine)
        return default_result

    monkeypatch.setattr("irminsul.quality.run_gate", fake_run_gate)
    assert main(["gate", "--cache-dir", gate_config.cache_dir, "--recompute-head", "32",
                 "--recompute-share", "0.1", "--recompute-rule", "signed",
                 "--recompute-check-layer", "3", "--no-sub-windows"]) == 0
    cache = seen[-1].cache
    assert (cache.recompute_head, cache.recompute_share) == (32, 0.1)
    assert (cache.recompute_rule, cache.recompute_check_layer) == ("signed", 3)
    assert cache.s1 is False and EngineConfig().cache.s1 is True
    assert main(["gate", "--cache-dir", gate_config.cache_dir]) == 0
    assert seen[-1].cache == EngineConfig().cache  # no flags: the default engine, as before
    assert main(["gate", "--recompute-share", "1.5"]) == 2
