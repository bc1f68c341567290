"""Output consistency of cached serving against full recomputation (the paper's Table 2, App. H).

Every request of a log, in log order, is served three ways:

    full    no cache at all: the prompt is recomputed from scratch and decoded greedily for N
            tokens, giving the reference continuation c and p_full at each of the N steps
    PIC     a persistent live engine (k_r rotated by δ on every registry hit)
    naive   a second persistent live engine whose runner copies k_r unrotated (NaiveReuseRunner)

The two engines are persistent so that each request sees the caches left by every earlier one,
as in serving. Each engine prefills the prompt and forks it: one fork is teacher-forced along c,
so p_x is compared with p_full on the same context at every step (KL(p_full || p_x), argmax-match
against c); the other decodes greedily until it first leaves c (the first-divergence position, N if
never). A request whose prompt reused nothing (no registry hit, and no derived prefix: an earlier
turn's rows computed over reused content) is served exactly like full recomputation up to float
noise, so the metrics are reported over the requests that reused content and over all requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ..config import CacheConfig, EngineConfig
from ..device import upload
from ..engine import Engine, ModelRunner
from ..engine.audit import kl_per_step
from ..engine.batch import Reuse
from ..model import MLAModel
from ..traffic.logs import Request
from ..traffic.prompt import Prompt, render_prompt
from ..traffic.render import ChatRenderer
from .report import table

MAX_SLOTS = 1 << 18  # per engine; 256K tokens of latent rows is ~8 GB for DeepSeek-V2-Lite in bf16
PATHS = ("pic", "naive")
METRICS = ("kl", "argmax", "first_divergence")


def render_prompts(renderer: ChatRenderer, requests: Iterable[Request],
                   vocab_size: int) -> list[tuple[str, Prompt]]:
    """Every request as (source, prompt with the engine's default resets), rendered up front so
    a tokenizer that does not fit the model fails before any model work and the KV pools can be
    sized from the whole workload."""
    prompts = []
    for request in requests:
        prompt = render_prompt(renderer, request.messages, request.tools,
                               session=request.session)
        if prompt.size and int(prompt.tokens.max()) >= vocab_size:
            raise ValueError(f"{request.source}: token id {int(prompt.tokens.max())} >= the "
                             f"model's vocab_size {vocab_size}; the tokenizer ({renderer.name}) "
                             "does not belong to this model")
        prompts.append((request.source, prompt))
    return prompts


def full_continuation(model: MLAModel, prompt: np.ndarray,
                      tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation with no cache reuse: one forward over the prompt, then incremental
    decoding against the sequence's own latent rows. Returns c and the logits [N, V] that
    predicted each of its tokens."""
    out = model.forward(torch.from_numpy(prompt.astype(np.int64)), torch.arange(prompt.size))
    rows, logits, continuation = out.latents, [out.logits[-1]], []
    for step in range(tokens):
        continuation.append(int(logits[-1].argmax()))
        if step + 1 == tokens:
            break
        out = model.forward(torch.tensor([continuation[-1]]), torch.tensor([prompt.size + step]),
                            rows)
        rows = [torch.cat([r, new]) for r, new in zip(rows, out.latents)]
        logits.append(out.logits[-1])
    return continuation, torch.stack(logits)


def serve(engine: Engine, prompt: Prompt, continuation: list[int],
          full_logits: torch.Tensor) -> dict:
    """Serve a prompt on an engine; compare its teacher-forced and free-running output with the
    full-recomputation continuation."""
    seq, first = engine.prefill(prompt.tokens, prompt.resets)
    twin = engine.fork(seq)
    try:
        forced = [first[None]]
        if len(continuation) > 1:
            forced.append(engine.extend(seq, continuation[:-1]))
        logits = torch.cat(forced)
        divergence, step_logits = 0, first
        for step, want in enumerate(continuation):  # free-running greedy, stopped at divergence
            if int(step_logits.argmax()) != want:
                break
            divergence = step + 1
            if divergence < len(continuation):
                step_logits = engine.extend(twin, [want])[-1]
    finally:
        engine.finish(seq)
        engine.finish(twin)
    stats = seq.stats
    matches = logits.argmax(-1).cpu() == torch.tensor(continuation)
    # How far full recomputation's own choice led its runner-up, at each step where this
    # path's argmax differs: a flip at a near-tie says little about the cache.
    top2 = full_logits.float().cpu().log_softmax(-1).topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    return {"kl": float(kl_per_step(full_logits, logits).mean()),
            "argmax": float(matches.double().mean()),
            "flips": [[step, margins[step]] for step in range(len(continuation))
                      if not bool(matches[step])],
            "reference_margins": margins,
            "first_divergence": divergence,
            "pic_tokens": stats.pic_tokens, "prefix_tokens": stats.prefix_tokens,
            "derived_prefix_tokens": stats.derived_prefix_tokens,
            "prefilled_tokens": stats.prefilled_tokens}


class NaiveReuseRunner(ModelRunner):
    """A model runner that reuses k_r as it was cached, unrotated: naive position-independent
    reuse, the baseline that shows what the δ-rotation buys."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "rotation": False})  # no captured rotation to keep

    def rotate(self, reuse: Reuse) -> None:
        device = self.kr.device
        self.kr[:, upload(reuse.dst, device)] = self.kr[:, upload(reuse.src, device)]


def _reused(served: dict) -> bool:
    """Whether a path served the request reused content: registry hits, or a derived prefix
    (an earlier turn's rows computed over reused content, matched in the radix tree)."""
    return bool(served["pic_tokens"] or served["derived_prefix_tokens"])


def _means(rows: list[dict], suffix: str = "") -> dict:
    """Per-path metric means over requests (each request has exactly N teacher-forced steps, so
    the mean of per-request means is the mean over tokens); None when there are no requests."""
    return {f"{metric}_{path}{suffix}":
            float(np.mean([r[path][metric] for r in rows])) if rows else None
            for metric in METRICS for path in PATHS}


def consistency(model: MLAModel, renderer: ChatRenderer, requests: Iterable[Request], *,
                tokens: int = 16, num_slots: int | None = None, heal: bool = False,
                cache: CacheConfig | None = None, progress: bool = False) -> dict:
    """Run the study over ``requests`` in order; returns the JSON report.

    Top-level metrics (``kl_pic``, ``argmax_naive``, ``first_divergence_pic``, ...) are over the
    requests where either engine served reused content (registry hits or a derived prefix);
    the same with an ``_all`` suffix are over every request. ``num_slots`` sizes each engine's
    KV pool; by default it holds the whole workload (capped at MAX_SLOTS), so nothing is
    evicted. ``heal``: after each request each engine heals what it reused
    (:meth:`~irminsul.engine.Engine.heal`), as a server with ``CacheConfig.heal`` does in the
    idle time between an agent's turns; without it (the default, as the server's), later
    requests build on reused rows. ``cache``: the planner config both live engines serve with
    (default :class:`CacheConfig`'s), ``heal`` set on it.
    """
    if tokens < 1:
        raise ValueError(f"need at least one continuation token, got {tokens}")
    cfg = model.config
    prompts = render_prompts(renderer, requests, cfg.vocab_size)
    for source, p in prompts:
        if p.size + tokens > cfg.max_position_embeddings:
            raise ValueError(f"{source}: {p.size} prompt tokens + {tokens} exceed the model's "
                             f"context of {cfg.max_position_embeddings}")
    if num_slots is None:
        # A request allocates at most its prompt (prefill, or fresh k_r for hits) and 2(N-1)
        # decoded tokens, so the sum over the log is more than an engine ever holds. When the
        # cap binds, a request must still fit beside the chunk sources its hits lock.
        total = sum(p.size + 2 * tokens for _, p in prompts)
        largest = max((2 * p.size + 2 * tokens for _, p in prompts), default=1)
        num_slots = max(min(total, MAX_SLOTS), largest)
    config = EngineConfig(slots=num_slots, mode="live",
                          cache=dataclasses.replace(cache or CacheConfig(), heal=heal))
    engines = {"pic": Engine(model, config),
               "naive": Engine(model, config, runner=NaiveReuseRunner)}
    rows = []
    for source, prompt in tqdm(prompts, desc="consistency", unit=" req", disable=not progress,
                               leave=False):
        continuation, full_logits = full_continuation(model, prompt.tokens, tokens)
        row = {"source": source, "prompt_tokens": prompt.size}
        for path, engine in engines.items():
            row[path] = serve(engine, prompt, continuation, full_logits)
            engine.heal()
        rows.append(row)
    for engine in engines.values():
        engine.check()  # the study doubles as an end-to-end check of the slot accounting
    hit = [r for r in rows if any(_reused(r[path]) for path in PATHS)]
    prompt_tokens = sum(r["prompt_tokens"] for r in rows)
    served = {path: {key: sum(r[path][key] for r in rows)
                     for key in ("pic_tokens", "prefix_tokens", "derived_prefix_tokens",
                                 "prefilled_tokens")}
              for path in PATHS}
    for path in PATHS:
        served[path]["requests_with_hits"] = sum(_reused(r[path]) for r in rows)
    return {
        "tokens": tokens,
        "requests": len(rows),
        "requests_with_hits": len(hit),
        "prompt_tokens": prompt_tokens,
        "pic_token_fraction": served["pic"]["pic_tokens"] / prompt_tokens if prompt_tokens else 0.0,
        "num_slots": num_slots,
        "heal": heal,
        **_means(hit),
        **_means(rows, "_all"),
        "served": served,
        "per_request": rows,
    }


def render_consistency(report: dict) -> str:
    """The report as a table: one row per cache path, over requests with hits and over all."""
    def cell(value: float | None, fmt: str) -> str:
        return "—" if value is None else format(value, fmt)

    rows = []
    for suffix, scope in (("", "hit requests"), ("_all", "all requests")):
        for path, name in (("pic", "PIC (δ-rotated)"), ("naive", "naive reuse")):
            rows.append([f"{name}, {scope}",
                         cell(report[f"kl_{path}{suffix}"], ".3g"),
                         cell(report[f"argmax_{path}{suffix}"], ".3f"),
                         cell(report[f"first_divergence_{path}{suffix}"], ".2f"),
                         f"{report['served'][path]['pic_tokens']:,}"])
    title = (f"Output consistency vs full recomputation ({report['tokens']} tokens per request; "
             f"{report['requests_with_hits']} of {report['requests']} requests with PIC hits, "
             f"{100 * report['pic_token_fraction']:.1f}% of prompt tokens served by PIC)")
    return table(title, ["cache path", "KL(p_full||p_x)", "argmax-match", "first divergence",
                         "PIC tokens"], rows)
