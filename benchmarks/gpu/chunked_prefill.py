"""A long prompt's prefill against the chunk size, alone and while other requests decode.

The engine prefills a prompt ``chunk_tokens`` at a time, each chunk in a forward of at most
``batch_tokens`` tokens shared with the running requests' decode steps. Small chunks keep those
steps short; large ones spend fewer forwards (each costs host time to launch, and each re-reads
the context it attends to). Per (chunk, budget) setting, with PIC off and random ids:

    alone  one fresh P-token prompt (max_tokens 1): median TTFT over ``--repeats`` after a
           warm-up; the forwards it took, how many replayed a CUDA graph, and the device's own
           time for one prompt (torch.profiler's kernel total; wall ÷ device above 1 is host
           time the device waited for);
    load   B requests decode over C-token contexts (filled with noise, as decode.py does) when
           the P-token prompt arrives (after one untimed arrival): its TTFT, and the decoders'
           step intervals meanwhile (median, max) and the tokens they produced per second.

The floor of a prefill is one forward over the whole prompt (the last setting by default: a
chunk as long as the prompt).

    python benchmarks/gpu/chunked_prefill.py --out F.json
    python benchmarks/gpu/chunked_prefill.py --device cpu --tiny --prompt 256 --chunks 64 256 \\
        --decoders 2 --context 64 --out F.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch
from common import build_model, run_metadata, sync
from decode import _stub_forward

from irminsul.config import EngineConfig
from irminsul.engine import Engine, SamplingParams, Scheduler
from irminsul.model import MLAModel

CHUNKS = [512, 2048, 4096, 8192, 16384]


def _drain(scheduler: Scheduler, rid: str) -> tuple[float, int]:
    """Step until request ``rid`` has its first token: (seconds, forwards)."""
    start, steps = time.perf_counter(), 0
    while True:
        outputs = scheduler.step()
        steps += 1
        errors = [o.error for o in outputs if o.error]
        if errors:
            raise RuntimeError(f"a request failed: {errors[0]}")
        if any(o.request_id == rid and o.new_tokens for o in outputs):
            return time.perf_counter() - start, steps


def _device_ms(device: str, scheduler: Scheduler, prompt: np.ndarray) -> float:
    """The device's kernel time (ms) for one prompt's prefill, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    if not device.startswith("cuda"):
        return float("nan")
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rid = scheduler.add(prompt, SamplingParams(max_tokens=1))
        _drain(scheduler, rid)
        while scheduler.has_work():
            scheduler.step()
        sync(device)
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def alone(model: MLAModel, chunk: int, budget: int, prompt_tokens: int, repeats: int,
          device: str) -> dict[str, Any]:
    """One prompt at a time, nothing else running."""
    vocab = model.config.vocab_size
    engine = Engine(model, EngineConfig(mode="off", slots=2 * prompt_tokens + 64))
    scheduler = Scheduler(engine, batch_tokens=budget, chunk_tokens=chunk)
    rng = np.random.default_rng(chunk)
    times, forwards, graphed = [], [], []
    for i in range(repeats + 1):
        replays = engine.runner.graph_replays
        sync(device)
        rid = scheduler.add(rng.integers(0, vocab, prompt_tokens), SamplingParams(max_tokens=1))
        elapsed, steps = _drain(scheduler, rid)
        sync(device)
        while scheduler.has_work():
            scheduler.step()
        if i:  # the first is the warm-up
            times.append(1e3 * elapsed)
            forwards.append(steps)
            graphed.append(engine.runner.graph_replays - replays)
    device_ms = _device_ms(device, scheduler, rng.integers(0, vocab, prompt_tokens))
    scheduler.check()
    ttft = statistics.median(times)
    return {"ttft_ms": ttft, "ttft_all_ms": times, "forwards": forwards[-1],
            "graphed_forwards": graphed[-1], "device_ms": device_ms,
            "wall_over_device": ttft / device_ms if device_ms == device_ms else None}


def under_load(model: MLAModel, chunk: int, budget: int, prompt_tokens: int, decoders: int,
               context: int, device: str) -> dict[str, Any]:
    """The prompt arriving while ``decoders`` requests decode over ``context`` tokens each."""
    vocab = model.config.vocab_size
    reply = 4096  # the decoders outlast the prompt's prefill
    engine = Engine(model, EngineConfig(mode="off", slots=decoders * (context + reply)
                                        + 2 * prompt_tokens + 64))
    scheduler = Scheduler(engine, batch_tokens=budget, chunk_tokens=chunk)
    rng = np.random.default_rng(1000 + chunk)
    ids = [scheduler.add(rng.integers(0, vocab, context), SamplingParams(max_tokens=reply))
           for _ in range(decoders)]
    undo = _stub_forward(scheduler, vocab)  # their contexts are not computed
    try:
        while scheduler.waiting or any(r.state == "prefill" for r in scheduler.running):
            scheduler.step()
    finally:
        undo()
    with torch.no_grad():
        engine.pool.ckv.normal_()
        engine.pool.kr.normal_()
    for _ in range(4):  # warm-up decode steps
        scheduler.step()
    # A warm-up prompt under the same load: shapes first seen (kernels compiled, attention
    # plans made) cost the first arrival alone.
    _drain(scheduler, scheduler.add(rng.integers(0, vocab, prompt_tokens),
                                    SamplingParams(max_tokens=1)))
    sync(device)
    rid = scheduler.add(rng.integers(0, vocab, prompt_tokens), SamplingParams(max_tokens=1))
    start = last = time.perf_counter()
    intervals, produced = [], 0
    decoding = set(ids)
    while True:
        outputs = scheduler.step()
        now = time.perf_counter()
        intervals.append(now - last)
        last = now
        produced += sum(len(o.new_tokens) for o in outputs if o.request_id in decoding)
        if any(o.request_id == rid and o.new_tokens for o in outputs):
            break
    ttft = now - start
    for request_id in ids:
        scheduler.abort(request_id)
    while scheduler.has_work():
        scheduler.step()
    scheduler.check()
    return {"ttft_ms": 1e3 * ttft, "steps": len(intervals),
            "decode_step_p50_ms": 1e3 * statistics.median(intervals),
            "decode_step_max_ms": 1e3 * max(intervals),
            "decode_tokens_per_s": produced / ttft}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny float32 model (CPU smoke)")
    parser.add_argument("--prompt", type=int, default=16384, help="prompt tokens (default 16K)")
    parser.add_argument("--chunks", type=int, nargs="+", default=CHUNKS,
                        help="chunk_tokens settings; batch_tokens is max(2048, chunk + "
                             "decoders) for each")
    parser.add_argument("--repeats", type=int, default=3, help="timed prompts alone")
    parser.add_argument("--decoders", type=int, default=32, help="requests decoding (load)")
    parser.add_argument("--context", type=int, default=4096, help="their contexts (load)")
    parser.add_argument("--out", required=True, help="results JSON")
    args = parser.parse_args()
    model = build_model(args.device, tiny=args.tiny)
    results: dict[str, Any] = {"meta": run_metadata(args.device), "prompt": args.prompt,
                               "decoders": args.decoders, "context": args.context, "cells": []}
    for chunk in args.chunks:
        budget = max(2048, chunk + args.decoders)
        cell = {"chunk_tokens": chunk, "batch_tokens": budget,
                "alone": alone(model, chunk, budget, args.prompt, args.repeats, args.device),
                "load": under_load(model, chunk, budget, args.prompt, args.decoders,
                                   args.context, args.device)}
        results["cells"].append(cell)
        a, b = cell["alone"], cell["load"]
        print(f"chunk {chunk:>6} budget {budget:>6}: alone TTFT {a['ttft_ms']:8.1f} ms "
              f"({a['forwards']} forwards, {a['graphed_forwards']} graphed, device "
              f"{a['device_ms']:.1f} ms) | load TTFT {b['ttft_ms']:8.1f} ms, decode step p50 "
              f"{b['decode_step_p50_ms']:.1f} max {b['decode_step_max_ms']:.1f} ms, "
              f"{b['decode_tokens_per_s']:.0f} tok/s", flush=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
