"""Live-PIC TTFT, decode throughput and the transformers baseline: the GPU suite's serving figures.

Per cell (pattern, prompt length, H), over the cell's requests after warm-ups, time to first token:

    no cache      a full prefill of the prompt (the engine, in a namespace of its own)
    exact prefix  the engine in ``off`` mode (the radix tree serves the unchanged prefix)
    PIC live      the engine in ``live`` mode (shifted chunks from the registry, k_r rotated)
    ideal         only the novel spans prefilled, everything else already cached at its positions

All four run through the engine's forward path (plain torch or the kernels, whichever it uses).

Run by ``benchmarks/gpu/suite.py``; the requests come from :mod:`shift_prompts`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
from common import AgentText, percentiles, timed
from shift_prompts import ShiftRequest

from irminsul.config import EngineConfig
from irminsul.engine import Engine, SamplingParams, Scheduler, Sequence
from irminsul.model import MLAModel

MODES = ("no cache", "exact prefix", "PIC live", "ideal")


def _device(model: MLAModel) -> torch.device:
    return model.lm_head.weight.device


def cache_slots(length: int, requests: int) -> int:
    """Pool slots of a caching engine in a cell: every request's prompt. A server gives its pool
    the memory its weights leave (an H200 serving V2-Lite holds some 3M tokens); a pool of a few
    prompts evicts an agent's persona, or a document, between the requests that share it, which
    the ideal counts as cached."""
    return (requests + 1) * length + 64


def no_cache(engine: Engine, request: ShiftRequest, namespace: int) -> None:
    """A full prefill through the serving path: a namespace no other request uses, so neither
    cache can serve anything."""
    seq, _ = engine.prefill(request.prompt, request.resets, namespace=namespace)
    engine.finish(seq, remember=False)


def ideal(engine: Engine, reference: Sequence, request: ShiftRequest) -> None:
    """Prefill only the request's novel spans and its last token, in one forward (as the live
    engine does), every other row taken as cached at its position from ``reference`` (a held
    sequence of the cell's length; its rows are timing stand-ins). What a cache holding all
    content already seen, at the right positions, would run — through the engine's own path."""
    last = request.prompt.size - 1
    compute = np.unique(np.concatenate(
        [np.arange(s, min(e, last)) for s, e in request.novel if s < last] + [np.array([last])]))
    cached = np.ones(request.prompt.size, dtype=bool)
    cached[compute] = False
    handles = reference.handles[:request.prompt.size].copy()
    engine.cache.make_room(compute.size)
    handles[compute] = engine.pool.alloc(compute.size)
    seq = Sequence(request.prompt, handles, reference.namespace)
    seq.owed.append(handles[cached])  # counted once the forward is issued, as in PIC live
    engine.sequences.append(seq)  # owned by the engine, so finish() releases it
    engine.run_batch([(seq, request.prompt[compute], compute)])
    engine.finish(seq, remember=False)


def ttft_cell(model: MLAModel, requests: list[ShiftRequest], warmup: int,
              make_engine: Callable[..., Engine] = Engine) -> dict[str, Any]:
    """TTFT p50/p95 per mode and the share of prompt tokens each cache served, over the
    requests after the first ``warmup`` (which fill the caches). ``make_engine``: builds each
    mode's engine (tensor parallel's leader: over its shard, on every rank)."""
    device = _device(model)
    length = requests[0].prompt.size
    small, large = 4 * length + 64, cache_slots(length, len(requests))  # without, with reuse
    engines = {name: make_engine(model, EngineConfig(slots=slots, mode=mode))
               for name, mode, slots in (("no cache", "off", small), ("exact prefix", "off", large),
                                         ("PIC live", "live", large), ("ideal", "off", small))}
    times: dict[str, list[float]] = {name: [] for name in MODES}
    served: dict[str, list[float]] = {"exact prefix": [], "PIC live prefix": [], "PIC live pic": [],
                                      "PIC live derived": []}
    reference, _ = engines["ideal"].prefill(requests[0].prompt, namespace=-1)  # held throughout
    for i, request in enumerate(requests):
        sample = {"no cache": timed(device, no_cache, engines["no cache"], request, i + 1)[0]}
        for name in ("exact prefix", "PIC live"):
            sample[name], (seq, _) = timed(device, engines[name].prefill, request.prompt,
                                           request.resets)
            if i >= warmup:
                if name == "PIC live":
                    served["PIC live pic"].append(seq.stats.pic_tokens / length)
                    # Rows an earlier turn reused, matched as a prefix: served from cache, but
                    # never counted as an exact prefix hit.
                    served["PIC live derived"].append(seq.stats.derived_prefix_tokens / length)
                served[name if name == "exact prefix" else "PIC live prefix"].append(
                    seq.stats.prefix_tokens / length)
            engines[name].finish(seq)
        sample["ideal"] = timed(device, ideal, engines["ideal"], reference, request)[0]
        if i >= warmup:
            for name, seconds in sample.items():
                times[name].append(seconds)
    engines["ideal"].finish(reference, remember=False)
    for engine in engines.values():
        engine.check()
        engine.close()  # under tensor parallel, the followers' pools are freed too
    result: dict[str, Any] = {"prompt_tokens": length, "requests": len(requests) - warmup,
                              "warmup": warmup}
    result.update({name: percentiles(values, 1e3) for name, values in times.items()})
    share = {name: float(np.mean(values)) for name, values in served.items()}
    result["served"] = {"exact prefix": share["exact prefix"],
                        "PIC live": share["PIC live prefix"] + share["PIC live pic"]
                        + share["PIC live derived"],
                        "PIC live via PIC": share["PIC live pic"],
                        "PIC live via a derived prefix": share["PIC live derived"]}
    result["novel_share"] = float(np.mean([sum(min(e, length - 1) - s for s, e in r.novel) / length
                                           for r in requests[warmup:]]))
    live = result["PIC live"]["p50_ms"]
    result["live_over_ideal"] = live / result["ideal"]["p50_ms"]
    result["exact_prefix_over_live"] = result["exact prefix"]["p50_ms"] / live
    return result


def decode_rate(model: MLAModel, text: AgentText, length: int, header: int, batch: int,
                tokens: int) -> dict[str, float]:
    """Decode tokens/s of ``batch`` concurrent agent_meta-style requests (own header, shared
    body), PIC live vs off: every request is prefilled first, then the decode steps alone are
    timed; tokens/s = batch / median step time."""
    device = _device(model)
    body = text.tokens[:length - header]
    out = {}
    for mode in ("off", "live"):
        config = EngineConfig(slots=(length + tokens) * (batch + 1), mode=mode)
        scheduler = Scheduler(Engine(model, config), batch_tokens=length + batch,
                              chunk_tokens=length)
        for i in range(batch):
            start = length + i * header
            scheduler.add(np.concatenate([text.tokens[start:start + header], body]),
                          SamplingParams(max_tokens=tokens), resets=[header])
        while scheduler.waiting or any(r.state == "prefill" for r in scheduler.running):
            scheduler.step()
        steps = []  # seconds of each step in which every request produced a token
        while scheduler.has_work():
            elapsed, outputs = timed(device, scheduler.step)
            if sum(len(o.new_tokens) for o in outputs) == batch:
                steps.append(elapsed)
        # The median step: kernels compile on the first steps of a new shape.
        out[mode] = batch / statistics.median(steps)
    out["live_over_off"] = out["live"] / out["off"]
    return out


def transformers_ttft(raw: dict[str, Any], device: str, lengths: list[int], text: AgentText,
                      requests: int) -> dict[int, dict[str, float]]:
    """What a user would otherwise run: transformers' ``generate`` (one new token, greedy) with
    its own DeepseekV2ForCausalLM on the same shapes (random, its own initialisation) and the
    same agent text; TTFT p50/p95 per length after one warm-up."""
    import transformers

    config = transformers.AutoConfig.for_model(**raw)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.DeepseekV2ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    out = {}
    for length in lengths:
        ids = torch.from_numpy(text.tokens[:length]).to(device)[None]
        first_token = partial(model.generate, ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=1, do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            values = [timed(device, first_token)[0] for _ in range(requests + 1)][1:]
        out[length] = percentiles(values, 1e3)
    del model
    return out
