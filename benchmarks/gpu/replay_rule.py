"""Which forwards replay a CUDA graph whole: live-PIC TTFT per request under the rule before
78d37e3 and the current one (``ModelRunner._replays_whole``), in one run.

Before, a batch with long spans replayed whole in the kernel while its long spans' attention
was at most ``GRAPH_PAIRS`` pairs. A new header split by reused sub-windows, its question past
``MERGED_MAX_KEYS`` (agent_meta at 16K tokens, H = 2000), passed: its short header spans and
its question were not counted, and in a launch past 1K tokens (64-row blocks, one key split a
request) one program walked the question's 16K keys. Now the spans the eager route would merge
count too, and no program may walk more than ``GRAPH_SPLIT_KEYS`` keys.

Per cell (pattern, length, H; the suite's requests, seeded as the suite seeds them), each rule
serves every request on a live engine of its own, beside the ideal (``ttft.ideal``): TTFT, the
tokens computed and whether each forward replayed whole. Printed: the requests that computed
over 100 tokens, then p50/p95 of live and ideal over the requests after the first two.

    python benchmarks/gpu/replay_rule.py [--cells agent_meta:16384:2000 rerank:16384:0] [--out F]
    python benchmarks/gpu/replay_rule.py --device cpu --tiny --cells agent_meta:1024:200   # smoke
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import numpy as np
from common import AgentText, build_model, run_metadata, timed
from shift_prompts import build_requests
from ttft import cache_slots, ideal

import irminsul.engine.model_runner as runner_module
from irminsul.config import EngineConfig
from irminsul.engine import Engine
from irminsul.engine.batch import ForwardBatch

WARMUP = 2


def rule_before(self: runner_module.ModelRunner, batch: ForwardBatch,
                item_spans: list[tuple[np.ndarray, ...]]) -> bool:
    """``ModelRunner._replays_whole`` as it was before 78d37e3: long spans' pairs only."""
    if self.graphs is None or batch.tokens.size > self.graphs.buckets[-1]:
        return False
    pairs, long_spans = 0, False
    for at, spans in zip(batch.positions, item_spans):
        for rows in spans:
            n = len(rows)
            if n >= self._naive_from:
                long_spans = True
                pairs += n * (int(at[rows[0]]) + (n + 1) // 2)
    return long_spans and pairs * self.model.config.num_attention_heads <= \
        runner_module.GRAPH_PAIRS


RULES: dict[str, Callable[..., bool]] = {"before": rule_before,
                                         "now": runner_module.ModelRunner._replays_whole}


def cell(model: Any, device: str, text: AgentText, pattern: str, length: int, header: int,
         requests: int) -> dict[str, Any]:
    """Each rule's per-request TTFT (ms), tokens computed and whole replays, and the ideal's."""
    shifts = build_requests(pattern, text, length, requests + WARMUP, header=header, seed=length)
    out: dict[str, Any] = {"pattern": pattern, "prompt_tokens": length, "header_tokens": header}
    whole: list[bool] = []
    for name, rule in RULES.items():
        def watched(self, batch, item_spans, rule=rule):  # noqa: ANN001, ANN202
            whole.append(rule(self, batch, item_spans))
            return whole[-1]

        runner_module.ModelRunner._replays_whole = watched
        try:
            live = Engine(model, EngineConfig(slots=cache_slots(length, len(shifts)), mode="live"))
            floor = Engine(model, EngineConfig(slots=4 * length + 64, mode="off"))
            reference, _ = floor.prefill(shifts[0].prompt, namespace=-1)
            rows = []
            for request in shifts:
                whole.clear()
                seconds, (seq, _) = timed(device, live.prefill, request.prompt, request.resets)
                row = {"ms": 1e3 * seconds, "computed": seq.stats.prefilled_tokens,
                       "whole": any(whole)}
                live.finish(seq)
                row["ideal_ms"] = 1e3 * timed(device, ideal, floor, reference, request)[0]
                rows.append(row)
            floor.finish(reference, remember=False)
            live.close()
            floor.close()
        finally:
            runner_module.ModelRunner._replays_whole = RULES["now"]
        timed_rows = rows[WARMUP:]
        out[name] = {"requests": rows,
                     **{f"{k}_p{q}": float(np.percentile([r[k] for r in timed_rows], q))
                        for k in ("ms", "ideal_ms") for q in (50, 95)}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="+", default=["agent_meta:16384:2000", "rerank:16384:0"],
                        help="PATTERN:LENGTH:HEADER")
    parser.add_argument("--requests", type=int, default=20, help="timed requests per cell")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny float32 model (CPU smoke)")
    parser.add_argument("--out", help="results JSON")
    args = parser.parse_args()
    model = build_model(args.device, tiny=args.tiny)
    text = AgentText(model.config.vocab_size)
    cells = []
    for spec in args.cells:
        pattern, length, header = spec.split(":")
        result = cell(model, args.device, text, pattern, int(length), int(header), args.requests)
        cells.append(result)
        print(f"== {pattern} {length} H{header}")
        for i, (before, now) in enumerate(zip(result["before"]["requests"],
                                              result["now"]["requests"])):
            if before["computed"] > 100:
                print(f"  request {i:2d}: computed {before['computed']:5d}  before "
                      f"{before['ms']:7.1f} ms (whole {before['whole']})  now {now['ms']:7.1f} ms "
                      f"(whole {now['whole']})  ideal {before['ideal_ms']:6.1f} ms")
        for name in RULES:
            r = result[name]
            print(f"  {name}: live p50 {r['ms_p50']:.2f} p95 {r['ms_p95']:.1f} ms, ideal p50 "
                  f"{r['ideal_ms_p50']:.2f} p95 {r['ideal_ms_p95']:.1f} ms", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({**run_metadata(args.device), "cells": cells}, f, indent=1)


if __name__ == "__main__":
    main()
