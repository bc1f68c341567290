"""Does any request wait on a Triton compile? Per request of a GPU suite TTFT cell: its time to
first token and the kernels Triton compiled inside it.

For each prompt length, a live-PIC engine and the ideal's (as ``ttft.py`` runs them) are built,
warmed up as a server warms up (``irminsul.engine.warmup``, unless ``--no-warm-up``), then serve
the cell's requests (``shift_prompts.build_requests``, seeded by the length as the suite seeds
them) one by one. A ``triton.knobs.runtime.jit_cache_hook`` counts every compile (a kernel run
with constexprs or argument specialisations not met before in this process; on a fresh machine
each costs 1-2 s). Printed: engine start time and its compiles, then each request with a
compile or with a TTFT over ``--slow`` ms, the compiled kernels and their constexprs.

    python benchmarks/gpu/request_compiles.py [--pattern rerank] [--lengths 16384 4096] [--out F]
    python benchmarks/gpu/request_compiles.py --device cpu --tiny --lengths 1024   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import triton
from common import AgentText, build_model, run_metadata, sync
from shift_prompts import PATTERNS, build_requests
from ttft import cache_slots, ideal

from irminsul.config import EngineConfig
from irminsul.engine import Engine
from irminsul.engine.scheduler import Scheduler
from irminsul.engine.warmup import warm_up

COMPILED: list[dict[str, Any]] = []


def _hook(*, key: Any, repr: str, fn: Any, compile: dict[str, Any], is_manual_warmup: bool,
          already_compiled: bool) -> None:
    constants = {str(k): v for k, v in compile["constants"].items() if v is not None}
    COMPILED.append({"kernel": fn.name, "constants": str(constants)[:300]})
    # None: go on and compile (True would skip the compile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny float32 model (CPU smoke)")
    parser.add_argument("--pattern", choices=PATTERNS, default="rerank")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 4096])
    parser.add_argument("--requests", type=int, default=22)
    parser.add_argument("--header", type=int, default=50, help="agent_meta / sysvar's H")
    parser.add_argument("--no-warm-up", action="store_true")
    parser.add_argument("--slow", type=float, default=50.0, help="ms: report requests over it")
    parser.add_argument("--out", help="also write the figures as JSON")
    args = parser.parse_args()
    triton.knobs.runtime.jit_cache_hook = _hook
    model = build_model(args.device, tiny=args.tiny)
    text = AgentText(model.config.vocab_size)
    out: dict[str, Any] = {"meta": run_metadata(args.device), "pattern": args.pattern, "cells": []}
    for length in args.lengths:
        header = 0 if args.pattern == "rerank" else args.header
        requests = build_requests(args.pattern, text, length, args.requests, header=header,
                                  seed=length)
        COMPILED.clear()
        start = time.perf_counter()
        live = Engine(model, EngineConfig(slots=cache_slots(length, len(requests)), mode="live"))
        cell: dict[str, Any] = {"length": length, "start_s": time.perf_counter() - start,
                                "start_compiles": len(COMPILED), "requests": []}
        ideal_engine = Engine(model, EngineConfig(slots=4 * length + 64, mode="off"))
        if not args.no_warm_up:
            cell["warm_up_s"] = [warm_up(Scheduler(e)).seconds for e in (live, ideal_engine)]
        print(f"{length}: engine start {cell['start_s']:.1f} s, {cell['start_compiles']} "
              f"compiles", flush=True)
        reference, _ = ideal_engine.prefill(requests[0].prompt, namespace=-1)
        for i, request in enumerate(requests):
            row: dict[str, Any] = {"request": i, "novel": sum(e - s for s, e in request.novel)}
            for name in ("live", "ideal"):
                COMPILED.clear()
                sync(args.device)
                began = time.perf_counter()
                if name == "live":
                    seq, _ = live.prefill(request.prompt, request.resets)
                    sync(args.device)
                    row["pic"] = seq.stats.pic_tokens
                    live.finish(seq)
                else:
                    ideal(ideal_engine, reference, request)
                    sync(args.device)
                row[name] = {"ms": (time.perf_counter() - began) * 1e3, "compiled": list(COMPILED)}
            cell["requests"].append(row)
            if any(row[n]["compiled"] or row[n]["ms"] > args.slow for n in ("live", "ideal")):
                print(f"  request {i}: novel {row['novel']}, PIC {row['pic']}; " + "; ".join(
                    f"{n} {row[n]['ms']:.1f} ms, compiled "
                    f"{[c['kernel'] for c in row[n]['compiled']]}" for n in ("live", "ideal")),
                    flush=True)
        ideal_engine.finish(reference, remember=False)
        compiles = sum(len(r[n]["compiled"]) for r in cell["requests"] for n in ("live", "ideal"))
        print(f"{length}: {compiles} compiles inside {len(requests)} requests × 2 arms", flush=True)
        out["cells"].append(cell)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
