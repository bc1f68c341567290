"""Warm-up before serving: the first requests of a fresh server should not pay for its start.

CUDA graphs are captured when the engine starts, but much of a forward runs outside them: long
prefill chunks (eager, with attention plans made per length and kernels compiled per launch
shape), chunks after their context, PIC's rotation and mixed spans, sampling's kernels, batches
mixing prefill spans with decode steps. Each is compiled or planned the first time it runs, and
on a fresh H200 the first arm of a serving replay waited seconds for that (bench serve's
append_only off arm: TTFT p99 5.9 s cold against 0.8 s warm). :func:`warm_up` runs a few
synthetic requests through the scheduler — the serving path itself — that cover those paths, in
a cache namespace no client can name, then evicts everything they left in the cache: the server
starts with an empty cache and nothing of the warm-up is reused, audited or counted.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import numpy as np

from .audit import PicAudit
from .sampler import SamplingParams
from .scheduler import Scheduler

HEADER_TOKENS = 64  # the header that shifts the warm-up body for PIC
SHORT_TOKENS = 200  # the short prompts that arrive together
SHORT_PROMPTS = 8
# Turns that extend the first prompt (an exact prefix hit, then a span after its context, as
# every agent's next call): lengths in both of Triton's integer classes (a multiple of 16 or not).
TAILS = (301, 1040)
REPLY_TOKENS = 8


@dataclass(frozen=True)
class WarmUpReport:
    """What the warm-up ran."""

    requests: int
    prompt_tokens: int
    prefix_tokens: int  # served by the exact prefix (the turns extending the first prompt)
    pic_tokens: int  # served by PIC (live mode: the shifted body reused)
    seconds: float


def warm_up(scheduler: Scheduler, seed: int = 0) -> WarmUpReport:
    """Run the warm-up's requests through ``scheduler`` (idle, nothing queued) and leave its
    cache empty. The requests, random ids in a namespace of their own (a random 64-bit seed,
    where clients' are hashes of the model name and their salt):

    1. a header and a body, longer than one prefill chunk together (where the pool and context
       allow): a chunk from scratch, then one after its context;
    2. together: another header and the same body (live mode reuses the body's chunks shifted:
       the rotation and spans around reused runs; a prompt's first chunk is never registered,
       hence the headers), turns extending the first prompt by :data:`TAILS` tokens (its
       exact prefix, then a span after it), and short prompts, some sampled at a temperature
       with top-k / top-p and a seed, all decoding a few tokens side by side.
    """
    if scheduler.has_work():
        raise RuntimeError("warm up an idle scheduler: requests are queued or running")
    start = time.perf_counter()
    limits = scheduler.limits
    # At least one token: a pool of a few hundred slots still runs every path, with less.
    room = max(1, min(limits.context, limits.pool_capacity) // 4 - HEADER_TOKENS - REPLY_TOKENS)
    body_tokens = max(1, min(scheduler.chunk_tokens + scheduler.chunk_tokens // 4, room))
    rng = np.random.default_rng(seed)
    body = rng.integers(0, limits.vocab_size, body_tokens)
    headers = rng.integers(0, limits.vocab_size, (2, HEADER_TOKENS))
    greedy = SamplingParams(max_tokens=REPLY_TOKENS)
    sampled = SamplingParams(max_tokens=REPLY_TOKENS, temperature=0.8, top_p=0.9, top_k=20,
                             seed=seed)
    namespace = secrets.randbits(64)
    audit, scheduler.audit = scheduler.audit, PicAudit(0.0)  # nothing of it is audited
    try:
        first = np.concatenate([headers[0], body])
        waves = [[(first, greedy)],
                 [(np.concatenate([headers[1], body]), greedy)]
                 + [(np.concatenate([first, rng.integers(0, limits.vocab_size, min(tail, room))]),
                     greedy) for tail in TAILS]
                 + [(rng.integers(0, limits.vocab_size, min(SHORT_TOKENS, room)),
                     sampled if i % 2 else greedy) for i in range(SHORT_PROMPTS)]]
        requests = prompt_tokens = prefix_tokens = pic_tokens = 0
        for wave in waves:
            for prompt, params in wave:
                # The body's first token starts a message: it is chunked alike after either header.
                resets = [HEADER_TOKENS] if prompt.size > body.size else []
                scheduler.add(prompt, params, resets=resets, namespace=namespace)
                requests += 1
                prompt_tokens += prompt.size
            while scheduler.has_work():
                for out in scheduler.step():
                    if out.error:
                        raise RuntimeError(f"the warm-up's request failed: {out.error}")
                    if out.stats is not None:  # with its first token
                        prefix_tokens += out.stats.prefix_tokens
                        pic_tokens += out.stats.pic_tokens
    finally:
        scheduler.audit = audit
    scheduler.cache.clear()
    scheduler.check()
    return WarmUpReport(requests, prompt_tokens, prefix_tokens, pic_tokens, time.perf_counter() - start)
