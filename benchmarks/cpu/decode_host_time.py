"""The host's time per decode step of B requests at context C, the device work stubbed out.

A decode step on a GPU is one CUDA-graph replay; everything around it — scheduling, the batch's
slots and keys, the graph's inputs (token ids, positions, the attention kernel's layout and every
request's key slots), sampling, appending — is host time the device waits for between steps
(the engine does not overlap steps yet). Here the real scheduler, cache manager, model runner and
graph input path run over a DeepSeek-V2-Lite-headed stand-in (16 heads, tiny widths) on the CPU;
the graph's replay and the logits head are stubbed, so what is timed is the host's part alone:
process CPU time per ``Scheduler.step``, median over the timed steps (CPU time, not wall time, so
other processes on the machine disturb it less).

    python benchmarks/cpu/decode_host_time.py [--batches 1 8 64 128] [--contexts 4096 16384]
                                              [--steps 40] [--out F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from common import TINY, run_metadata  # noqa: E402
from decode import _stub_forward  # noqa: E402

from irminsul.config import EngineConfig  # noqa: E402
from irminsul.engine import Engine, SamplingParams, Scheduler  # noqa: E402
from irminsul.engine.graphs import CudaGraphs  # noqa: E402
from irminsul.model import parse_config  # noqa: E402
from irminsul.model.random_weights import random_model  # noqa: E402

HEADS = 16  # DeepSeek-V2-Lite's: the kernel layout's blocks are one token's 16 heads


def decode_cell(batch: int, context: int, steps: int, warmup: int) -> dict[str, Any]:
    """Median host CPU ms per decode step of ``batch`` requests with ``context`` tokens each."""
    config = parse_config(dict(TINY, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                               max_position_embeddings=4 * context))
    model = random_model(config, "cpu", torch.float32)
    # Room for the tokens the requests whose prefill completed first decode while others prefill.
    vocab, total = config.vocab_size, warmup + steps + 8 + batch
    engine = Engine(model, EngineConfig(mode="off", slots=batch * (context + total) + 64,
                                        kernels=False, graphs=False))
    scheduler = Scheduler(engine, batch_tokens=8 * context + batch, chunk_tokens=context)
    rng = np.random.default_rng(batch * 7919 + context)
    for _ in range(batch):
        scheduler.add(rng.integers(0, vocab, context), SamplingParams(max_tokens=total))
    runner = engine.runner
    # Prefill without computing it: every request's first token from random logits.
    undo = _stub_forward(scheduler, vocab)
    while scheduler.waiting or any(r.state == "prefill" for r in scheduler.running):
        scheduler.step()
    undo()
    # Decode through the graph path, with its replays and the logits head stubbed: the engine
    # builds every input a replay reads (off a GPU the graphs' buffer is host memory).
    runner.kernels = True
    graphs = CudaGraphs(model, runner.ckv, runner.kr, scratch=(0, 0))
    hidden = config.hidden_size
    graphs.forwards = {launch: (lambda n=launch[0]: torch.zeros(n, hidden))
                       for launch in graphs.forwards}
    runner.graphs = graphs
    model.head = lambda x, lengths, rows: list(torch.randn(len(lengths), 1, vocab))
    for _ in range(warmup):
        scheduler.step()
    times = []
    for _ in range(steps):
        start = time.process_time()
        outputs = scheduler.step()
        times.append(time.process_time() - start)
        if sum(len(o.new_tokens) for o in outputs) != batch:
            raise RuntimeError(f"{batch} requests decoded {len(outputs)} tokens")
    # Each step replays one forward: its own, or (launched ahead) the next one's, so the last
    # step may have queued one more.
    if graphs.replays.total() not in (warmup + steps, warmup + steps + 1):
        raise RuntimeError("a step did not take the graph path")
    return {"batch": batch, "context": context, "host_ms": 1e3 * statistics.median(times),
            "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps per cell first")
    parser.add_argument("--out", help="results JSON")
    args = parser.parse_args()
    # The stubbed logits' argmax runs on the CPU here (on a GPU it is a kernel): one thread, so
    # that torch's intra-op threads do not spin against the rest of the machine.
    torch.set_num_threads(1)
    results = {"meta": {**run_metadata("cpu"), "cpu": platform.processor() or platform.machine(),
                        "numpy": np.__version__}, "cells": []}
    for context in args.contexts:
        for batch in args.batches:
            cell = decode_cell(batch, context, args.steps, args.warmup)
            results["cells"].append(cell)
            print(f"context {context:>6}  batch {batch:>4}: host {cell['host_ms']:6.2f} ms per "
                  "step", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
