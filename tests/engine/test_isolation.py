"""One request never fails another: a fault while planning, computing or sampling one request
finishes it alone, and every other request's tokens are those of a run without it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fixtures.tiny_models import build

import irminsul.engine.scheduler as scheduler_module
from irminsul.config import EngineConfig
from irminsul.engine import CacheManager, Engine, SamplingParams, Scheduler
from irminsul.engine.sampler import sample
from irminsul.model import load_model

POISON = 666  # the namespace of the request the injected faults hit


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v3")
    build("v3_like", directory)
    return load_model(directory)


def _prompts(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    doc = rng.integers(0, 97, 200)
    return [np.concatenate([rng.integers(0, 97, int(rng.integers(3, 40))), doc])
            for _ in range(count)]


def _run(model, *, poison: bool, greedy: bool = False
         ) -> tuple[dict[str, list[int]], dict[str, str], Scheduler]:
    """Four sampled requests (each seeded; greedy ones with ``greedy``), plus the poisoned one
    when asked, run to the end under a batch budget that chunks their prefills; tokens and
    errors by request id."""
    scheduler = Scheduler(Engine(model, EngineConfig(slots=3000, mode="live")),
                          batch_tokens=160, chunk_tokens=64)
    prompts = _prompts(5)
    temperature = 0.0 if greedy else 0.8
    for i, prompt in enumerate(prompts[:4]):
        scheduler.add(prompt, SamplingParams(max_tokens=12, temperature=temperature, seed=i),
                      request_id=f"r{i}")
    if poison:
        scheduler.add(prompts[4], SamplingParams(max_tokens=12, temperature=temperature, seed=9),
                      namespace=POISON, request_id="poison")
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    while scheduler.has_work():
        for out in scheduler.step():
            tokens.setdefault(out.request_id, []).extend(out.new_tokens)
            if out.error is not None:
                errors[out.request_id] = out.error
        scheduler.engine.check()  # slot accounting exact after every step
    return tokens, errors, scheduler


def _poisoned(seq) -> bool:
    return seq.namespace == POISON


@pytest.fixture(scope="module")
def clean(model) -> dict[str, list[int]]:
    """The four innocent requests' tokens in a run without the poisoned one."""
    tokens, errors, _ = _run(model, poison=False)
    assert not errors and all(len(t) == 12 for t in tokens.values())
    return tokens


@pytest.fixture(scope="module")
def clean_greedy(model) -> dict[str, list[int]]:
    """The four innocent requests' tokens, greedy, in a run without the poisoned one."""
    tokens, errors, _ = _run(model, poison=False, greedy=True)
    assert not errors and all(len(t) == 12 for t in tokens.values())
    return tokens


def _fails_alone(model, clean: dict[str, list[int]], message: str, *, greedy: bool = False
                 ) -> tuple[dict[str, list[int]], Scheduler]:
    """Run with the poisoned request: it alone fails, with ``message`` in its error, and the
    others' tokens are those of the clean run."""
    got, errors, scheduler = _run(model, poison=True, greedy=greedy)
    assert set(errors) == {"poison"} and message in errors["poison"]
    assert {k: v for k, v in got.items() if k != "poison"} == clean
    return got, scheduler


def test_a_sampling_fault_fails_its_request_alone(model, clean, monkeypatch) -> None:
    def faulty(logits, params, generator):
        if params.seed == 9:
            raise RuntimeError("probability tensor contains either inf, nan")
        return sample(logits, params, generator)

    monkeypatch.setattr(scheduler_module, "sample", faulty)
    _, scheduler = _fails_alone(model, clean, "sampling failed")
    assert scheduler.load().failed == 1


def test_a_forward_fault_fails_its_request_alone(model, clean, monkeypatch) -> None:
    """A batched forward that raises because of one request is run again request by request:
    the others' tokens are unchanged (every step of theirs ran once more, writing the same
    rows) and only the poisoned request fails."""
    real = Engine.run_batch

    def faulty(self, work, **kw):
        if any(_poisoned(seq) for seq, _, _ in work):
            raise RuntimeError("injected forward fault")
        return real(self, work, **kw)

    monkeypatch.setattr(Engine, "run_batch", faulty)
    _fails_alone(model, clean, "injected forward fault")


def test_a_planning_fault_fails_its_request_alone(model, clean, monkeypatch) -> None:
    engine_advance = Engine.advance

    def faulty_advance(self, prefill, budget):
        if _poisoned(prefill.seq):
            raise RuntimeError("injected planning fault")
        return engine_advance(self, prefill, budget)

    monkeypatch.setattr(Engine, "advance", faulty_advance)
    _fails_alone(model, clean, "injected planning fault")


def test_admission_fault_fails_its_request_alone(model, clean, monkeypatch) -> None:
    real = CacheManager.start_prefill

    def faulty(self, tokens, resets=(), *, namespace=0):
        if namespace == POISON:
            raise RuntimeError("injected admission fault")
        return real(self, tokens, resets, namespace=namespace)

    monkeypatch.setattr(CacheManager, "start_prefill", faulty)
    got, _ = _fails_alone(model, clean, "injected admission fault")
    assert got["poison"] == []


def _poison_logits(monkeypatch, bad: str) -> None:
    """The poisoned request's logits for its fourth output token (the forward that feeds it
    its third: its sequence then holds the prompt and two tokens) made ``bad``: one NaN, one
    +inf, or every entry -inf."""
    real = Engine.run_batch
    prompt = _prompts(5)[4]

    def faulty(self, work, **kw):
        logits = real(self, work, **kw)
        for i, (seq, _, _) in enumerate(work):
            if _poisoned(seq) and len(seq.tokens) == len(prompt) + 2:
                logits[i] = logits[i].clone()  # an inference tensor: not written in place
                row = logits[i][-1]
                if bad == "-inf":
                    row.fill_(-math.inf)
                else:
                    row[5] = math.nan if bad == "nan" else math.inf
        return logits

    monkeypatch.setattr(Engine, "run_batch", faulty)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_non_finite_logits_fail_their_request_alone(model, clean, clean_greedy, monkeypatch,
                                                    bad: str, greedy: bool) -> None:
    """Logits with a NaN, a +inf or nothing above -inf give no token to pick (a greedy argmax
    would take the NaN's or the +inf's index, or 0): that request fails with an error naming
    the cause and how far it got, after the three tokens it had; the others (sharing its
    greedy argmax launch and read-back) keep the tokens of a run without it."""
    _poison_logits(monkeypatch, bad)
    got, scheduler = _fails_alone(model, clean_greedy if greedy else clean,
                                  "logits are not finite (NaN or infinite) after 3 generated "
                                  "tokens", greedy=greedy)
    assert len(got["poison"]) == 3
    assert scheduler.load().failed == 1 and not scheduler.engine.sequences


# -- sampling parameters that used to crash the shared step ----------------------------------

LOGITS = torch.tensor([0.5, 3.0, 1.0, -2.0, 3.0 - 1e-3])


@pytest.mark.parametrize("params", [dict(temperature=1e-40), dict(temperature=1e-6),
                                    dict(temperature=1.0, top_p=1e-45),
                                    dict(temperature=1.0, top_p=1e-300),
                                    dict(temperature=2e-5, top_p=0.5)])
def test_extreme_parameters_pick_the_top_token(params: dict) -> None:
    """A temperature too small to sample with is greedy, a top_p that rounds to zero keeps the
    top token: the argmax (index 1), never an error."""
    assert sample(LOGITS, SamplingParams(**params), np.random.default_rng(0)) == 1


def test_non_finite_logits_raise_a_clear_error() -> None:
    logits = LOGITS.clone()
    logits[2] = math.nan
    with pytest.raises(ValueError, match="not finite"):
        sample(logits, SamplingParams(temperature=1.0), np.random.default_rng())


@pytest.mark.parametrize("bad", [dict(temperature=math.nan), dict(temperature=math.inf),
                                 dict(top_p=math.nan), dict(seed=2**64),
                                 dict(seed=-(2**63) - 1)])
def test_parameters_that_cannot_be_sampled_with_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_a_fault_finishing_a_request_fails_it_alone(model, clean, monkeypatch) -> None:
    """Inserting a finished request into the prefix index (its prompt and output) raises: that
    request fails alone, its slots freed; the requests finishing or decoding in the same step
    keep their tokens (the step used to raise, and the server then failed the whole batch)."""
    from irminsul.cache.planner import Planner

    real = Planner.remember
    prompt = _prompts(5)[4]

    def faulty(self, tokens, handles, namespace=0, exact=None):
        if namespace == POISON and len(tokens) > len(prompt):  # its finish, not its prefill
            raise RuntimeError("injected fault remembering")
        return real(self, tokens, handles, namespace, exact)

    monkeypatch.setattr(Planner, "remember", faulty)
    got, scheduler = _fails_alone(model, clean, "injected fault remembering")
    assert len(got["poison"]) == 11  # every token but the one whose finish failed
    assert scheduler.load().failed == 1 and not scheduler.engine.sequences


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_generate_refuses_non_finite_logits_and_frees_the_sequence(model, monkeypatch,
                                                                   bad: str) -> None:
    """The synchronous API's greedy loop: where a step's logits give no token (a NaN, a +inf,
    all -inf) it raises NonFiniteLogits naming how far it got, instead of taking the NaN's
    index or 0, and the sequence's slots are all back (the engine's own check)."""
    from irminsul.engine.sampler import NonFiniteLogits

    engine = Engine(model, EngineConfig(slots=600, mode="live"))
    prompt = _prompts(1)[0]
    want, _ = Engine(model, EngineConfig(slots=600, mode="live")).generate(prompt, 6)
    extend, calls = engine.extend, []

    def poisoned(seq, tokens):  # noqa: ANN001, ANN202
        logits = extend(seq, tokens)
        calls.append(1)
        if len(calls) == 3:  # the third generated token's logits
            logits = logits.clone()
            logits[-1] = float(bad) if bad != "-inf" else -math.inf
            if bad == "nan":
                logits[-1, :5] = 1.0  # finite values before the NaN: argmax still takes it
        return logits

    monkeypatch.setattr(engine, "extend", poisoned)
    with pytest.raises(NonFiniteLogits, match="after 3 generated tokens"):
        engine.generate(prompt, 6)
    engine.check()
    monkeypatch.setattr(engine, "extend", extend)
    assert engine.generate(prompt, 6)[0] == want  # the engine serves on, as before


def test_a_fault_committing_a_prefill_leaves_no_slot_registered_uncounted(tmp_path,
                                                                       monkeypatch) -> None:
    """Inserting a prefilled prompt into the prefix index raises (the fault the test above
    injects at a finish, here at the prefill's commit, after its chunks were registered): that
    request fails alone, and the registry holds nothing of it uncounted. It used to keep the
    chunks naming slots the failed request gave back, so a later prompt reusing the document
    was served whatever another request wrote there next. By hand: one layer, where live PIC
    reuse is exact, so that prompt's logits must be the cache-off engine's."""
    from irminsul.cache.planner import Planner

    build("v3_like", tmp_path, layers=1)
    model = load_model(tmp_path)
    rng = np.random.default_rng(8)
    doc = rng.integers(0, 97, 160)
    first = np.concatenate([rng.integers(0, 97, 40), doc])
    other = rng.integers(0, 97, 200)
    moved = np.concatenate([rng.integers(0, 97, 70), doc, rng.integers(0, 97, 5)])
    real = Planner.remember

    def faulty(self, tokens, handles, namespace=0, exact=None):
        if np.array_equal(tokens, first):  # its prefill's commit
            raise RuntimeError("injected fault inserting the prompt")
        return real(self, tokens, handles, namespace, exact)

    monkeypatch.setattr(Planner, "remember", faulty)
    engine = Engine(model, EngineConfig(slots=1000, mode="live"))
    scheduler = Scheduler(engine, batch_tokens=512, chunk_tokens=512)
    errors = []
    for prompt, resets in ((first, [40]), (other, [])):  # the second takes the freed slots
        scheduler.add(prompt, SamplingParams(max_tokens=4), resets=resets)
        while scheduler.has_work():
            errors += [out.error for out in scheduler.step() if out.error is not None]
            scheduler.check()  # every slot's count equals its references
    assert len(errors) == 1 and "injected fault inserting the prompt" in errors[0]
    assert not engine.sequences
    seq, logits = engine.prefill(moved, [70, 70 + doc.size])
    assert seq.stats.pic_tokens > 0  # something was reused from the registry
    engine.finish(seq)
    engine.check()
    _, want = Engine(model, EngineConfig(slots=1000, mode="off")).prefill(moved)
    assert (logits - want).abs().max() <= 1e-4 * want.abs().max()
