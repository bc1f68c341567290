"""The PIC correctness gate: is position-independent reuse safe on this checkpoint?

Each probe of :mod:`.probes` is served by two persistent live engines, as ``irminsul
consistency`` serves a log (its machinery, :mod:`irminsul.analysis.consistency`): one whose
runner rotates reused ``k_r`` by δ (PIC; the engine's own runner, or one a test injects) and
one whose runner copies it unrotated (naive reuse). ``seen`` is prefilled into both, so its
content is registered; ``moved`` is then recomputed from scratch by a third engine that reuses
nothing (the reference: greedy for ``tokens`` tokens, on the same kernels, so the figures
measure reuse and not kernel rounding) and served by each live engine, teacher-forced along the
reference. A probe's ``follow_up`` is served the same way after ``moved``, as a result of its
own (kind ``second_turn``): each live engine serves it moved's rows as a derived prefix — its
own PIC rows, or naive reuse's — so it measures what a second turn inherits. The engines are
built by ``open_engine`` (:class:`~irminsul.engine.Engine`, or tensor parallel's leader, whose
engines run on every rank's shard). The figures are means over the results whose prompt reused
content (PIC tokens, or a derived prefix):

    kl_pic, kl_naive     KL(p_full || p_x) per continuation token, nats
    argmax               share of steps where PIC's argmax is the reference's token
    first_divergence     the step where PIC's free-running greedy output first leaves the
                         reference (``tokens`` if never)

The verdict (:func:`judge`) applies :class:`~irminsul.config.GateConfig`'s thresholds. A
measurement is cached per checkpoint hash and measurement setup (:mod:`.result_cache`) and
judged again on every read, so changing a threshold needs no new measurement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import __version__
from ..analysis.consistency import NaiveReuseRunner, render_prompts, serve
from ..config import EngineConfig, GateConfig
from ..engine import Engine, ModelRunner
from ..engine.model_runner import resolve_backend
from ..model import MLAModel
from ..traffic.prompt import Prompt
from ..traffic.render import ChatRenderer
from . import result_cache
from .probes import Probe, gate_probes

log = logging.getLogger(__name__)

# How the gate builds an engine: Engine's signature (model, config, *, runner=).
EngineFactory = Callable[..., Engine]


@dataclass(frozen=True)
class ProbeResult:
    """One probe's moved request served by both engines against full recomputation."""

    name: str
    kind: str
    prompt_tokens: int
    pic_tokens: int  # prompt tokens PIC served from the registry
    kl_pic: float
    kl_naive: float
    argmax_pic: float
    argmax_naive: float
    first_divergence_pic: int
    first_divergence_naive: int
    # Prompt tokens served as a derived prefix (rows an earlier turn computed over reused
    # content); with pic_tokens 0 as well the result measured no reuse.
    derived_tokens: int = 0

    @property
    def reused(self) -> bool:
        """Whether this prompt was served any reused content (the verdict's means are over
        these)."""
        return self.pic_tokens > 0 or self.derived_tokens > 0


@dataclass(frozen=True)
class GateResult:
    """The gate's figures (means over the results that reused content), its verdict and why."""

    checkpoint: str  # checkpoint_hash of the model directory
    passed: bool
    reason: str
    kl_pic: float
    kl_naive: float
    argmax: float  # PIC's argmax match
    argmax_naive: float
    first_divergence: float  # PIC's, in tokens
    first_divergence_naive: float
    tokens: int  # continuation tokens per probe
    thresholds: dict[str, Any]  # what the verdict applied: max_kl, below_naive, min_argmax
    probes: tuple[ProbeResult, ...]
    cached: bool = False  # read from the result cache, not measured now

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN figures, where nothing was measured, as null)."""
        data = dataclasses.asdict(self)
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in data.items()}


class GateError(ValueError):
    """The probes cannot run on this checkpoint (a tokenizer that does not fit the model, a
    context too short for them): the gate cannot vouch for live reuse."""


def judge(checkpoint: str, probes: tuple[ProbeResult, ...], config: GateConfig, *,
          cached: bool = False) -> GateResult:
    """The verdict on a measurement under ``config``'s thresholds, checked in this order: PIC
    served some probe, KL(full||PIC) <= max_kl, KL(full||PIC) < KL(full||naive) (with
    below_naive), argmax match >= min_argmax. NaN figures fail every check."""
    served = [p for p in probes if p.reused]

    def mean(field: str) -> float:
        return float(np.mean([getattr(p, field) for p in served])) if served else math.nan

    kl_pic, kl_naive, argmax = mean("kl_pic"), mean("kl_naive"), mean("argmax_pic")
    if not served:
        refusal = (f"PIC served none of the {len(probes)} probes' reused content: there is "
                   "nothing to vouch for")
    elif not kl_pic <= config.max_kl:
        refusal = f"KL(full||PIC) {kl_pic:.3g} exceeds the threshold {config.max_kl:g}"
    elif config.below_naive and not kl_pic < kl_naive:
        refusal = (f"KL(full||PIC) {kl_pic:.3g} is not below naive reuse's {kl_naive:.3g}: "
                   "rotating k_r by δ does no better than not rotating it on this model")
    elif not argmax >= config.min_argmax:
        refusal = (f"PIC's argmax matches full recomputation at {argmax:.3f} of the steps, "
                   f"below {config.min_argmax:g}")
    else:
        refusal = None
    reason = refusal or (f"KL(full||PIC) {kl_pic:.3g} <= {config.max_kl:g}"
                         + (f", below naive reuse's {kl_naive:.3g}" if config.below_naive else "")
                         + f"; argmax match {argmax:.3f} >= {config.min_argmax:g}")
    thresholds = {"max_kl": config.max_kl, "below_naive": config.below_naive,
                  "min_argmax": config.min_argmax}
    return GateResult(checkpoint, refusal is None, reason, kl_pic, kl_naive, argmax,
                      mean("argmax_naive"), mean("first_divergence_pic"),
                      mean("first_divergence_naive"), config.tokens, thresholds, probes, cached)


ProbePrompts = tuple[Prompt, Prompt, Prompt | None]  # seen, moved, follow-up (or None)


def render_probes(model: MLAModel, renderer: ChatRenderer, probes: list[Probe],
                  tokens: int) -> list[ProbePrompts]:
    """Each probe's (seen, moved, follow-up or None) prompts in the checkpoint's own rendering;
    GateError if they do not fit the model."""
    cfg = model.config
    requests = [r for p in probes for r in (p.seen, p.moved, p.follow_up) if r is not None]
    try:
        rendered = iter(render_prompts(renderer, requests, cfg.vocab_size))
    except ValueError as err:
        raise GateError(str(err)) from err
    out = []
    for probe in probes:
        parts = [next(rendered) for r in (probe.seen, probe.moved, probe.follow_up)
                 if r is not None]
        for source, prompt in parts:
            if prompt.size + tokens > cfg.max_position_embeddings:
                raise GateError(f"{source}: {prompt.size} tokens + {tokens} exceed the model's "
                                f"context of {cfg.max_position_embeddings}")
        prompts = [p for _, p in parts]
        out.append((prompts[0], prompts[1], prompts[2] if len(prompts) > 2 else None))
    return out


def reference(engine: Engine, prompt: Prompt, tokens: int,
              namespace: int) -> tuple[list[int], torch.Tensor]:
    """Full recomputation of ``prompt`` on ``engine`` (mode off) and its greedy continuation of
    ``tokens`` tokens; returns the continuation and the logits [tokens, V] that predicted each
    of its tokens. ``namespace``: one no other prompt of the engine used, so that not even an
    exact prefix is reused (mode off still caches those)."""
    seq, logits = engine.prefill(prompt.tokens, prompt.resets, namespace=namespace)
    steps, continuation = [logits], []
    try:
        for step in range(tokens):
            continuation.append(int(steps[-1].argmax()))
            if step + 1 < tokens:
                steps.append(engine.extend(seq, continuation[-1:])[-1])
    finally:
        engine.finish(seq, remember=False)
    return continuation, torch.stack(steps)


def measure(model: MLAModel, probes: list[Probe], prompts: list[ProbePrompts], *,
            tokens: int, engine: EngineConfig | None = None,
            runner: type[ModelRunner] = ModelRunner,
            open_engine: EngineFactory = Engine) -> tuple[ProbeResult, ...]:
    """Serve every probe (see the module's docstring); ``engine``: the served engine's settings
    (kernels, planner), of which the gate's engines keep all but the pool and the mode;
    ``runner``: the PIC engine's model runner; ``open_engine``: builds the three engines."""
    # A request allocates at most its prompt and 2(N-1) decoded tokens: the sum over the probes
    # is more than an engine ever holds, so nothing is evicted. CUDA graphs replay the same
    # kernels as eager launches; capturing them for throwaway engines is not worth it.
    slots = sum(p.size + 2 * tokens for parts in prompts for p in parts if p is not None)
    config = dataclasses.replace(engine or EngineConfig(), mode="live", slots=slots,
                                 kr_slots=None, graphs=False)
    results = []
    with contextlib.ExitStack() as closing:  # what was opened is closed, whatever happens

        def opening(mode: str, runner: type[ModelRunner]) -> Engine:
            opened = open_engine(model, dataclasses.replace(config, mode=mode), runner=runner)
            closing.callback(opened.close)
            return opened

        full = opening("off", ModelRunner)
        engines = {"pic": opening("live", runner), "naive": opening("live", NaiveReuseRunner)}
        for number, (probe, (seen, moved, follow_up)) in enumerate(zip(probes, prompts), 1):
            for eng in engines.values():  # registers seen's content in both engines
                seq, _ = eng.prefill(seen.tokens, seen.resets)
                eng.finish(seq)
            turns = [(probe.name, probe.kind, moved)]
            if follow_up is not None:  # after moved, whose rows it is served
                turns.append((f"{probe.name}, second turn", "second_turn", follow_up))
            for turn, (name, kind, prompt) in enumerate(turns):
                continuation, full_logits = reference(full, prompt, tokens,
                                                      namespace=2 * number + turn)
                row = {path: serve(eng, prompt, continuation, full_logits)
                       for path, eng in engines.items()}
                results.append(ProbeResult(
                    name, kind, prompt.size, row["pic"]["pic_tokens"], row["pic"]["kl"],
                    row["naive"]["kl"], row["pic"]["argmax"], row["naive"]["argmax"],
                    row["pic"]["first_divergence"], row["naive"]["first_divergence"],
                    row["pic"]["derived_prefix_tokens"]))
        for eng in (full, *engines.values()):
            eng.check()  # the gate doubles as a check of the slot accounting
    return tuple(results)


def _key(checkpoint: str, model: MLAModel, prompts: list[ProbePrompts], tokens: int,
         engine: EngineConfig | None, runner: type[ModelRunner]) -> dict[str, Any]:
    """What a measurement depends on besides the checkpoint: the probes as this checkpoint's
    tokenizer renders them, the continuation length, where and how the model runs (the shard
    under tensor parallel), the reference, the planner, the runner, and the version of the
    engine measured."""
    engine = engine or EngineConfig()
    weight = model.lm_head.weight
    digest = hashlib.sha256()
    for prompt in (p for parts in prompts for p in parts if p is not None):
        digest.update(prompt.tokens.astype("<u4").tobytes() + b"|")
        digest.update(prompt.resets.astype("<u4").tobytes() + b";")
    kernels, _ = resolve_backend(model, engine.kernels, False)
    return {"checkpoint": checkpoint, "irminsul": __version__, "probes": digest.hexdigest(),
            "tokens": tokens, "device": weight.device.type, "dtype": str(weight.dtype),
            "kernels": kernels, "shard": model.shard, "reference": "engine, mode off, own namespace",
            "planner": repr(engine.cache),
            "runner": f"{runner.__module__}.{runner.__qualname__}"}


def run_gate(model: MLAModel, renderer: ChatRenderer, checkpoint: str,
             config: GateConfig | None = None, *, engine: EngineConfig | None = None,
             runner: type[ModelRunner] = ModelRunner, fresh: bool = False,
             probes: list[Probe] | None = None,
             open_engine: EngineFactory = Engine) -> GateResult:
    """The gate on a loaded checkpoint (``checkpoint``: its :func:`~.checkpoint.checkpoint_hash`;
    ``renderer``: its tokenizer and chat template): the cached measurement for this checkpoint
    and setup if there is one (unless ``fresh``), else a new one, cached; judged under
    ``config``. ``engine``, ``runner`` and ``open_engine`` as :func:`measure` takes them (under
    tensor parallel ``model`` is rank 0's shard, ``open_engine`` the leader's); ``probes``: the probe
    set (default :func:`~.probes.gate_probes`). A checkpoint the probes cannot run on is refused
    with the reason (never cached: finding that out is cheap)."""
    config = config or GateConfig()
    probes = gate_probes() if probes is None else probes
    try:
        prompts = render_probes(model, renderer, probes, config.tokens)
    except GateError as err:
        return dataclasses.replace(judge(checkpoint, (), config),
                                   reason=f"the probes cannot run on this checkpoint: {err}")
    directory = result_cache.cache_dir(config)
    parts = _key(checkpoint, model, prompts, config.tokens, engine, runner)
    stored = None if fresh else result_cache.load(directory, parts)
    if stored is not None:
        try:
            return judge(checkpoint, tuple(ProbeResult(**p) for p in stored), config,
                         cached=True)
        except TypeError:  # written by another version of ProbeResult: measure again
            pass
    results = measure(model, probes, prompts, tokens=config.tokens, engine=engine, runner=runner,
                      open_engine=open_engine)
    try:
        result_cache.save(directory, parts, [dataclasses.asdict(r) for r in results])
    except OSError as err:  # a read-only home must not stop a server from starting
        log.warning("PIC gate: could not cache the result in %s (%s)", directory, err)
    return judge(checkpoint, results, config)
