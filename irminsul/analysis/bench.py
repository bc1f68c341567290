"""``irminsul bench``: replay a workload against the live engine in each cache mode.

Requests are served one after another in log order (each agent call waits for the previous one),
by a fresh engine per mode: ``off`` (exact-prefix only), ``observer`` (would-be PIC hits recorded,
outputs as off) and ``live``. Per mode: the share of prompt tokens served by the exact prefix and
by PIC, time to first token (prefill + first logits) p50/p95, and the mean KL divergence of the
first-token distribution from full recomputation without any cache.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import torch
from tqdm import tqdm

from ..config import MODES, EngineConfig
from ..engine import Engine
from ..engine.audit import kl_per_step
from ..model import MLAModel
from ..traffic.prompt import Prompt


def bench(model: MLAModel, prompts: Iterable[Prompt], *, num_slots: int,
          modes: Iterable[str] = MODES, progress: bool = False) -> dict:
    """Serve every prompt in each mode; returns {mode: figures} plus the request count.

    ``progress`` shows a bar on stderr over every pass of every request: the full-recomputation
    reference first, then each mode.
    """
    prompts, modes = list(prompts), list(modes)
    if not prompts:
        raise ValueError("no requests to replay")
    bar = tqdm(total=len(prompts) * (1 + len(modes)), desc="bench: reference", unit=" req",
               disable=not progress, leave=False)
    full = []
    for p in prompts:
        full.append(model.logits(torch.from_numpy(p.tokens.astype(np.int64)))[-1])
        bar.update()
    result: dict = {"requests": len(prompts), "prompt_tokens": sum(p.size for p in prompts)}
    for mode in modes:
        bar.set_description(f"bench: {mode}")
        engine = Engine(model, EngineConfig(slots=num_slots, mode=mode))
        counts = np.zeros(3, dtype=np.int64)  # prefix, pic (served or would-be), prompt
        ttft, kl = [], []
        for prompt, reference in zip(prompts, full):
            started = time.perf_counter()
            seq, logits = engine.prefill(prompt.tokens, prompt.resets)
            # The first token known on the host: on a GPU the forward returns before the device
            # is done, and the clock must wait for it.
            int(logits.argmax())
            ttft.append(time.perf_counter() - started)
            engine.finish(seq)
            s = seq.stats
            # A derived prefix (an earlier turn's reused rows, matched in the radix tree) is
            # reuse too: counted with PIC, never as the exact prefix.
            counts += (s.prefix_tokens,
                       s.pic_tokens + s.would_be_pic_tokens + s.derived_prefix_tokens,
                       s.prompt_tokens)
            kl.append(float(kl_per_step(reference[None], logits[None])[0]))
            bar.update()  # after the clock stopped: drawing the bar is no part of the TTFT
        engine.check()
        prefix, pic, total = counts.tolist()
        result[mode] = {
            "exact_prefix": prefix / total, "pic_unique": pic / total,
            "total": (prefix + pic) / total, "pic_served": mode == "live",
            "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
            "ttft_p95_ms": 1e3 * float(np.percentile(ttft, 95)),
            "kl_first_token": float(np.mean(kl)),
        }
    bar.close()
    return result
