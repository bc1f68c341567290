"""The attention kernel on short forwards over long contexts: what a live-PIC prefill computes.

A PIC prefill computes few tokens (a changed header, a rewritten tool result, the prompt's last
token) over a context that is mostly reused rows. Each cell is one layer of DeepSeek-V2-Lite's
attention (16 heads, c_KV 512 + k_r 64, bf16) over one prompt, timed as device time per call
(``common.per_call``), for each launch rule (:data:`LAUNCHES`):

    m64 splits   64-row blocks (four tokens' heads each), each request's keys split evenly over
                 programs for two waves: the launch prefill forwards took until now
    m16 pieces   16-row blocks (one token's heads each), each block's keys cut by what it may
                 see into pieces for one wave (FlashMLA's scheduler; the decode launch)
    aligned      the same, pieces of whole 64-key steps (fewer pieces, as many steps)
    row merge    the same, the pieces merged a row per program (more programs per block)

Shapes: ``line`` is agent_meta's forward (a 31-token request line at position 50, then the
last token over every key); ``span N`` is N novel tokens at the end of the context (a fresh
tail after reused content); ``decode B`` B requests' decode steps, each over keys of its own
(the same short-bucket graphs replay them, so a rule for short forwards must not slow them).
The floor is the larger of the bytes the requests' keys hold over the copy bandwidth and the
FLOPs every row's visible keys cost (q·[c_KV, k_r] and p·c_KV) over the bf16 matmul peak.

``--engine`` also times live-PIC TTFT through the engine (CUDA graphs on, as it serves) with
each launch rule for short forwards: the median over agent_meta and rerank requests of the GPU
suite's TTFT cells (``shift_prompts``), PIC live only, a fresh engine per rule and cell.

    python benchmarks/gpu/span_attention.py [--engine] --out F.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import numpy as np
import roofline
import torch
from common import V2_LITE, AgentText, build_model, per_call, percentiles, run_metadata, timed
from shift_prompts import build_requests
from ttft import cache_slots

from irminsul.config import EngineConfig
from irminsul.engine import Engine
from irminsul.kernels import PagedLayout, mla_attention, paged_mla_attention
from irminsul.model import parse_config
from irminsul.model.rope import softmax_scale

HEADS, RANK, ROPE = 16, 512, 64
PEAK_TFLOPS = 780.0  # bf16 dense matmul, measured on the H200 (the brief)
# Each launch rule: rows per block (None: the rule's own choice), and the kernel module's
# settings it runs under (SHORT_FORWARD 0: no forward counts as short, the rule before: 64 rows
# but for decode steps).
LAUNCHES: dict[str, tuple[int | None, dict[str, int]]] = {
    "m64 splits": (None, dict(SHORT_FORWARD=0, SCHEDULE_ALIGN=1)),
    "m16 pieces": (16, dict(SHORT_FORWARD=512, SCHEDULE_ALIGN=1, MERGE_BY_ROW_UP_TO=0)),
    "m16 aligned": (16, dict(SHORT_FORWARD=512, SCHEDULE_ALIGN=64, MERGE_BY_ROW_UP_TO=0)),
    "m16 aligned, row merge": (16, dict(SHORT_FORWARD=512, SCHEDULE_ALIGN=64, MERGE_ROWS=1,
                                        MERGE_BY_ROW_UP_TO=64)),
}


@contextmanager
def rule(settings: dict[str, int]) -> Iterator[None]:
    """The kernel module under ``settings`` (the graphs take its rule too)."""
    saved = {k: getattr(mla_attention, k) for k in settings}
    try:
        for k, v in settings.items():
            setattr(mla_attention, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(mla_attention, k, v)


def shapes(context: int, spans: list[int], decodes: list[int]
           ) -> list[tuple[str, list[int], list[int], bool]]:
    """(label, new tokens per request, keys before them, whether each request has keys of its
    own) of one context's cells: one prompt's spans share its keys; decode steps of several
    requests (what the same graphs replay) each read their own."""
    cells = [("line", [31, 1], [50, context - 1], False)]
    cells += [(f"span {n}", [n], [context - n], False) for n in spans]
    return cells + [(f"decode {b}", [1] * b, [context - 1] * b, True) for b in decodes]


def measure(context: int, spans: list[int], decodes: list[int], copy_gbps: float,
            repeats: int, device: str = "cuda") -> list[dict]:
    scale = softmax_scale(parse_config(V2_LITE))
    gen = torch.Generator(device=device).manual_seed(0)
    rng = np.random.default_rng(context)
    slots = max([1, *decodes]) * context + 64
    ckv = torch.randn(slots, RANK, device=device, generator=gen).bfloat16()
    kr = torch.randn(slots, ROPE, device=device, generator=gen).bfloat16()
    rows = []
    for label, new, before, own in shapes(context, spans, decodes):
        # A prompt's keys, scattered over the pool as reused rows are; each span of it is a
        # request of the layout over the keys up to its own last token, as the engine lays out
        # a prompt's spans. Decode requests: each its own region of the pool.
        shared = rng.permutation(context)
        keys = [i * context + rng.permutation(context)[:b + n] if own else shared[:b + n]
                for i, (n, b) in enumerate(zip(new, before))]
        q = (torch.randn(sum(new), HEADS, RANK + ROPE, device=device, generator=gen) * 0.1)
        q = q.bfloat16()
        visible = sum(sum(b + i + 1 for i in range(n)) for n, b in zip(new, before))
        flops = 2 * HEADS * visible * (RANK + ROPE + RANK)
        read = [b + n for n, b in zip(new, before)]
        nbytes = (sum(read) if own else max(read)) * ((RANK + ROPE) * 2 + 8)
        floor_ms = max(nbytes / (copy_gbps * 1e9), flops / (PEAK_TFLOPS * 1e12)) * 1e3
        row: dict = {"context": context, "shape": label, "tokens": sum(new),
                     "floor_ms": floor_ms, "bound": "bytes" if
                     nbytes / copy_gbps / 1e9 > flops / PEAK_TFLOPS / 1e12 else "flops"}
        outs = {}
        for name, (block_m, settings) in LAUNCHES.items():
            with rule(settings):
                layout = PagedLayout.build(new, keys, keys, HEADS, device, block_m=block_m)
                fn = partial(paged_mla_attention, q, ckv, kr, layout, scale)
                outs[name] = fn().float()
                row[name] = percentiles([per_call(device, fn).device for _ in range(repeats)],
                                        1e3)
            row[name]["programs"] = (layout.programs if layout.schedule is not None
                                     else layout.block_req.numel() * layout.splits)
        first, *others = outs.values()
        row["max_abs_diff"] = max(float((o - first).abs().max() / first.abs().max())
                                  for o in others)
        rows.append(row)
        print(f"{context:>6} {label:>9}  floor {floor_ms * 1e3:7.1f} us ({row['bound']})  "
              + "  ".join(f"{k} {row[k]['p50_ms'] * 1e3:7.1f}" for k in LAUNCHES)
              + f"  diff {row['max_abs_diff']:.1e}", flush=True)
    return rows


def engine_ttft(patterns: list[str], lengths: list[int], requests: int, warmup: int,
                device: str = "cuda", tiny: bool = False,
                save: Callable[[list[dict]], None] = lambda rows: None,
                arms: list[str] | None = None) -> list[dict]:
    """Live-PIC TTFT p50/p95 per (pattern, length) under each launch rule for short forwards
    (:data:`LAUNCHES`; ``m64 splits``: no forward counts as short, the rule before).
    ``tiny``: the tiny float32 model (a CPU smoke of this code, not a measurement)."""
    model = build_model(device, tiny=tiny)
    text = AgentText(model.config.vocab_size)
    rows = []
    for pattern in patterns:
        for length in lengths:
            batch = build_requests(pattern, text, length, requests + warmup, seed=length)
            row: dict = {"pattern": pattern, "prompt_tokens": length}
            for arm in arms or list(LAUNCHES):
                with rule(LAUNCHES[arm][1]):  # read when a layout is built or a graph captured
                    engine = Engine(model, EngineConfig(slots=cache_slots(length, len(batch)),
                                                        mode="live"))
                    times = []
                    for i, request in enumerate(batch):
                        elapsed, (seq, _) = timed(device, engine.prefill, request.prompt,
                                                  request.resets)
                        engine.finish(seq)
                        if i >= warmup:
                            times.append(elapsed)
                    engine.close()
                row[arm] = percentiles(times, 1e3)
            rows.append(row)
            save(rows)
            print(f"TTFT {pattern:>10} {length:>6}  " + "  ".join(
                f"{arm} {row[arm]['p50_ms']:6.1f} ms" for arm in arms or LAUNCHES), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--spans", type=int, nargs="+", default=[8, 32, 64, 128, 256, 512])
    parser.add_argument("--decodes", type=int, nargs="+", default=[16, 64],
                        help="decode batches (one token each over its own keys)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--engine", action="store_true", help="also live-PIC TTFT per rule")
    parser.add_argument("--patterns", nargs="+", default=["agent_meta", "rerank"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--requests", type=int, default=8, help="timed requests per TTFT cell")
    parser.add_argument("--arms", nargs="+", choices=list(LAUNCHES),
                        help="the rules TTFT is timed under (default: every one)")
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args()
    copy_gbps = roofline.copy_bandwidth("cuda")
    out = {"meta": run_metadata("cuda"), "copy_gbps": copy_gbps, "peak_tflops": PEAK_TFLOPS,
           "short_forward": mla_attention.SHORT_FORWARD}

    def save(**more: list[dict]) -> None:  # after each part: a run cut short keeps what it did
        out.update(more)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=1)

    save(rows=[row for context in args.contexts
               for row in measure(context, args.spans, args.decodes, copy_gbps, args.repeats)])
    if args.engine:
        engine_ttft(args.patterns, args.lengths, args.requests, warmup=2,
                    save=lambda rows: save(ttft=rows), arms=args.arms)


if __name__ == "__main__":
    main()
