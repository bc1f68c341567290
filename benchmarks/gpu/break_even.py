"""Where reuse starts to pay: TTFT of a new header, then D tokens seen before, then one token.

Each request is a header of its own (``--header`` tokens, new: computed in every mode), then a
document of D tokens that an earlier request registered behind another header (so only live PIC
can reuse it, at a shifted position), then one new token. Per D, the median time to first token
over ``--requests`` requests after a warm-up, through ``Engine.prefill``:

    off    the engine with PIC off: the document is computed again
    live   the engine with live PIC: the document's chunks reused, k_r rotated by δ

The break-even D is the smallest from which live is faster than off at every larger D measured.
Agent text from the shipped samples (token ids folded into the model's vocabulary).

    python benchmarks/gpu/break_even.py --out F.json
    python benchmarks/gpu/break_even.py --device cpu --tiny --docs 64 256 --header 128 --out F
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import numpy as np
from common import AgentText, build_model, run_metadata, sync, timed

from irminsul.config import EngineConfig
from irminsul.engine import Engine
from irminsul.model import MLAModel

DOCS = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


def cell(model: MLAModel, text: AgentText, doc_tokens: int, header: int, requests: int,
         device: str, profile: bool = False) -> dict[str, Any]:
    """Median TTFT (ms) off and live, and the tokens live served by PIC, for one D (with
    ``profile``, each mode's last request also under torch.profiler: its table in the result)."""
    doc = text.tokens[:doc_tokens]
    pool = text.tokens[doc_tokens:]
    # Distinct headers: the first registers the document, one warms up, the rest are timed.
    headers = [pool[i * header:(i + 1) * header] for i in range(requests + 2)]
    out: dict[str, Any] = {"doc_tokens": doc_tokens}
    for mode in ("off", "live"):
        engine = Engine(model, EngineConfig(mode=mode, slots=(requests + 3) * (header + doc_tokens
                                                                                + 2) + 64))
        times, pic = [], []
        for i, head in enumerate(headers):
            last = pool[-(i + 1):len(pool) - i]  # one token of its own
            prompt = np.concatenate([head, doc, last])
            resets = [header, header + doc_tokens]  # message edges: the document is a message
            if profile and i == len(headers) - 1:
                out[f"{mode}_profile"] = _profiled(device, engine, prompt, resets)
                continue
            elapsed, (seq, _) = timed(device, engine.prefill, prompt, resets)
            if i >= 2:
                times.append(elapsed)
                pic.append(seq.stats.pic_tokens)
            engine.finish(seq, remember=i == 0)  # only the first request's content is kept
        engine.check()
        out[mode] = {"ttft_ms": 1e3 * statistics.median(times), "pic_tokens": statistics.median(pic)}
    out["live_minus_off_ms"] = out["live"]["ttft_ms"] - out["off"]["ttft_ms"]
    return out


def _profiled(device: str, engine: Engine, prompt: np.ndarray, resets: list[int]) -> str:
    """torch.profiler's table of one prefill (device and host time per operator)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        seq, _ = engine.prefill(prompt, resets)
        sync(device)
    engine.finish(seq, remember=False)
    key = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60)


def break_even(cells: list[dict[str, Any]]) -> int | None:
    """The smallest D from which live is faster than off at every larger D measured."""
    found = None
    for c in sorted(cells, key=lambda c: c["doc_tokens"], reverse=True):
        if c["live_minus_off_ms"] >= 0:
            break
        found = c["doc_tokens"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny float32 model (CPU smoke)")
    parser.add_argument("--docs", type=int, nargs="+", default=DOCS, help="values of D")
    parser.add_argument("--header", type=int, default=1024, help="new header tokens")
    parser.add_argument("--requests", type=int, default=8, help="timed requests per D and mode")
    parser.add_argument("--profile", type=int, metavar="D",
                        help="also profile one request of each mode at this D")
    parser.add_argument("--out", required=True, help="results JSON")
    args = parser.parse_args()
    model = build_model(args.device, tiny=args.tiny)
    text = AgentText(model.config.vocab_size)
    results: dict[str, Any] = {"meta": run_metadata(args.device), "header": args.header,
                               "requests": args.requests, "cells": []}
    for doc_tokens in args.docs:
        c = cell(model, text, doc_tokens, args.header, args.requests, args.device,
                 profile=doc_tokens == args.profile)
        results["cells"].append(c)
        print(f"D {doc_tokens:>5}: off {c['off']['ttft_ms']:8.2f} ms  live {c['live']['ttft_ms']:8.2f}"
              f" ms  (PIC {c['live']['pic_tokens']:.0f} tokens)  live - off "
              f"{c['live_minus_off_ms']:+7.2f} ms", flush=True)
        for mode in ("off", "live"):
            if f"{mode}_profile" in c:
                print(f"--- {mode}, D {doc_tokens}\n{c[f'{mode}_profile']}", flush=True)
        results["break_even_doc_tokens"] = break_even(results["cells"])
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    print(f"break-even D: {results['break_even_doc_tokens']} tokens")


if __name__ == "__main__":
    main()
