"""The TTFT each repair setting costs: agent_meta prompts whose header changed, the body reused.

Each request is agent_meta-shaped, as the GPU suite's TTFT cells build them
(:func:`shift_prompts.build_requests`): one of a few agent personas (``--header`` tokens) and a
per-request line (request id, time), then a body every request shares. The line's length varies,
so the body sits at a shifted position: only live PIC reuses it. Per setting a fresh engine serves
the same requests in order through ``Engine.prefill``; the median time to first token over
``--requests`` requests after two warm-ups (the first registers the body, the second runs the
reuse path once). Where the engine runs the Triton kernels, every setting first runs once untimed,
so that no kernel compiles inside a timed request:

    off        PIC off: the body computed again (the exact prefix serves the persona at most)
    live       live PIC, no repair
    head k     live, recompute_head = k: the first k tokens of every reused run computed
               (EPIC-style), for each k of ``--heads``
    share r    live, recompute_share = r: the share r of the reused tokens whose c_KV at layer 1
               deviates most computed (CacheBlend-style; a check forward through layer 0 picks
               them), for each r of ``--shares``
    signed r Ln  live, recompute_share = r with recompute_rule "signed" and n check layers
               (``--signed``, ``--check-layers``): the share whose fresh rows most lower the
               prompt tail's attention error at layers 1..n (a check forward through n layers
               and one attention backward per layer pick them)
    recent r (+ head k)  live, recompute_share = r with recompute_rule "recent": the share of
               the reused tokens nearest the prompt's end, no check forward (``--recent``), with
               recompute_head = k as well for each k of ``--recent-heads`` (0: none)

Per setting also the tokens PIC served and the tokens repair computed instead. ServeStats records
no recomputed count, so it is live's PIC tokens less the setting's, request by request: every
engine plans the same requests alike (repair changes only how a plan is served), as
benchmarks/cpu/repair.py counts its recomputed share. KL and argmax per setting are that
benchmark's (docs/results/cpu-repair.json); this one times them on random V2-Lite weights.

Every engine runs with CUDA graphs off (``--graphs`` turns them on for all settings alike). A
setting is an engine of its own (CacheConfig is frozen, and the engine reads its repair knobs
when it starts), and capturing the graphs takes ~20 s per engine start: ten settings would spend
minutes capturing. Off for all, the settings compare like for like; serving's default replays
short spans from graphs, so live's absolute TTFT here is above the suite's (a forward of over 2K
tokens, as share 15% runs at 16K, replays none anyway).

    python benchmarks/gpu/repair_ttft.py --out F.json
    python benchmarks/gpu/repair_ttft.py --device cpu --tiny --tokens 1024 --requests 2 --out F \
        [--threads 1]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import torch
from common import AgentText, build_model, run_metadata, timed
from shift_prompts import ShiftRequest, build_requests
from ttft import cache_slots

from irminsul.config import CacheConfig, EngineConfig
from irminsul.engine import Engine
from irminsul.engine.model_runner import default_kernels
from irminsul.model import MLAModel

WARMUP = 2  # the first request registers the body; the second is the first served from it


def settings(heads: list[int], shares: list[float], signed: list[float] = (),
             check_layers: list[int] = (3,), no_sub_windows: bool = False,
             recent: list[float] = (), recent_heads: list[int] = (0,)
             ) -> list[tuple[str, str, CacheConfig]]:
    """(label, mode, cache config) of every setting: off, live without repair, (live without the
    registry's sub-windows,) then each k, each r, and each signed r at each number of check
    layers."""
    return ([("off", "off", CacheConfig()), ("live", "live", CacheConfig())]
            + ([("no sub-windows", "live", CacheConfig(s1=False))] if no_sub_windows else [])
            + [(f"head {k}", "live", CacheConfig(recompute_head=k)) for k in heads]
            + [(f"share {r:.0%}", "live", CacheConfig(recompute_share=r)) for r in shares]
            + [(f"signed {r:.0%} L{n}", "live",
                CacheConfig(recompute_share=r, recompute_rule="signed",
                            recompute_check_layer=n))
               for r in signed for n in check_layers]
            + [(f"recent {r:.0%}" + (f" + head {k}" if k else ""), "live",
                CacheConfig(recompute_share=r, recompute_rule="recent", recompute_head=k))
               for k in recent_heads for r in recent])


def measure(model: MLAModel, requests: list[ShiftRequest], mode: str, cache: CacheConfig,
            device: str, graphs: bool) -> dict[str, Any]:
    """One setting: per timed request its TTFT (s) and where its tokens came from."""
    length = requests[0].prompt.size
    engine = Engine(model, EngineConfig(mode=mode, slots=cache_slots(length, len(requests)),
                                        graphs=graphs, cache=cache))
    rows: dict[str, list[float]] = {"ttft_s": [], "pic_tokens": [], "prefilled_tokens": []}
    for i, request in enumerate(requests):
        elapsed, (seq, _) = timed(device, engine.prefill, request.prompt, request.resets)
        if i >= WARMUP:
            rows["ttft_s"].append(elapsed)
            rows["pic_tokens"].append(seq.stats.pic_tokens)
            rows["prefilled_tokens"].append(seq.stats.prefilled_tokens)
        engine.finish(seq)  # remembered, as a server does: the next request's persona is a prefix
    engine.check()
    del engine
    gc.collect()  # the pool's rows go before the next setting's engine allocates its own
    return rows


def summary(label: str, mode: str, cache: CacheConfig, rows: dict[str, list[float]],
            live: dict[str, list[float]] | None) -> dict[str, Any]:
    """Medians of one setting; its recomputed tokens against ``live`` (no repair), request by
    request (None for off, and before live is measured)."""
    out: dict[str, Any] = {
        "setting": label, "mode": mode, "recompute_head": cache.recompute_head,
        "recompute_share": cache.recompute_share, "recompute_rule": cache.recompute_rule,
        "recompute_check_layer": cache.recompute_check_layer, "sub_windows": cache.s1,
        "ttft_ms": 1e3 * statistics.median(rows["ttft_s"]),
        "ttft_ms_all": [1e3 * s for s in rows["ttft_s"]],
        "pic_tokens": statistics.median(rows["pic_tokens"]),
        "prefilled_tokens": statistics.median(rows["prefilled_tokens"]),
        "recomputed_tokens": None}
    if mode == "live" and live is not None:
        out["recomputed_tokens"] = statistics.median(
            base - pic for base, pic in zip(live["pic_tokens"], rows["pic_tokens"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny float32 model (CPU smoke)")
    parser.add_argument("--tokens", type=int, default=16384, help="prompt tokens")
    parser.add_argument("--pattern", choices=("agent_meta", "rerank"), default="agent_meta",
                        help="the requests' shape, as the GPU suite's TTFT cells build it")
    parser.add_argument("--header", type=int, default=50,
                        help="agent persona tokens (H; agent_meta only)")
    parser.add_argument("--requests", type=int, default=8, help="timed requests per setting")
    parser.add_argument("--heads", type=int, nargs="*", default=[2, 4, 8, 16, 32],
                        help="values of recompute_head (k)")
    parser.add_argument("--shares", type=float, nargs="*", default=[0.05, 0.10, 0.15],
                        help="values of recompute_share (r)")
    parser.add_argument("--signed", type=float, nargs="*", default=[],
                        help="recompute shares r under the signed rule (none by default)")
    parser.add_argument("--recent", type=float, nargs="*", default=[],
                        help="recompute shares r under the recent rule (none by default)")
    parser.add_argument("--recent-heads", type=int, nargs="+", default=[0],
                        help="EPIC heads k computed with each --recent share as well")
    parser.add_argument("--check-layers", type=int, nargs="+", default=[3],
                        help="check layers n of the signed settings")
    parser.add_argument("--no-sub-windows", action="store_true",
                        help="also live PIC without the registry's sub-windows (CacheConfig.s1 "
                        "off, serve --no-sub-windows)")
    parser.add_argument("--graphs", action="store_true",
                        help="CUDA graphs on in every engine (each start captures them, ~20 s)")
    parser.add_argument("--threads", type=int,
                        help="torch CPU threads (default: torch's; 1 for the tiny model on shared "
                        "cores, where spinning threads cost more than they give)")
    parser.add_argument("--out", required=True, help="results JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = build_model(args.device, tiny=args.tiny)
    text = AgentText(model.config.vocab_size)
    # The suite's requests, seeded by the length as its cells are (rerank: no persona).
    header = args.header if args.pattern == "agent_meta" else 0
    requests = build_requests(args.pattern, text, args.tokens, args.requests + WARMUP,
                              header=header, seed=args.tokens)
    results: dict[str, Any] = {
        "meta": run_metadata(args.device),
        "model": "tiny random" if args.tiny else "random DeepSeek-V2-Lite shapes, bf16",
        "pattern": args.pattern, "tokens": args.tokens, "header": header,
        "requests": args.requests,
        "warmup": WARMUP, "graphs": args.graphs, "settings": []}
    configs = settings(args.heads, args.shares, args.signed, args.check_layers,
                       args.no_sub_windows, args.recent, args.recent_heads)
    if default_kernels(model):
        # Every setting once untimed first: Triton compiles a kernel variant on the first call
        # of each new specialisation (span sizes differ by setting and request), taking seconds
        # that would otherwise land in one setting's timed requests.
        for _, mode, cache in configs:
            measure(model, requests, mode, cache, args.device, args.graphs)
    live: dict[str, list[float]] | None = None
    for label, mode, cache in configs:
        rows = measure(model, requests, mode, cache, args.device, args.graphs)
        if label == "live":
            live = rows
        s = summary(label, mode, cache, rows, live)
        results["settings"].append(s)
        base = next((r["ttft_ms"] for r in results["settings"] if r["setting"] == "live"), None)
        versus = f"  {s['ttft_ms'] - base:+8.2f} ms vs live" if base is not None else ""
        recomputed = "" if s["recomputed_tokens"] is None else \
            f"  recomputed {s['recomputed_tokens']:6.0f}"
        print(f"{label:>10}: TTFT {s['ttft_ms']:8.2f} ms{versus}  PIC {s['pic_tokens']:6.0f}"
              f"{recomputed} tokens", flush=True)
        results["wall_s"] = time.perf_counter() - started
        with open(args.out, "w", encoding="utf-8") as f:  # a run cut short keeps what finished
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
