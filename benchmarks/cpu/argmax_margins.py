"""Where live PIC's greedy token differs from full recomputation's, how close was full
recomputation's own choice? ``irminsul consistency``'s measurement per planner option (those of
benchmarks/cpu/planner_quality.py), each flipped step with the reference's top-1 minus top-2
log-probability: a flip where the reference itself nearly tied says little about the cache.

    python benchmarks/cpu/argmax_margins.py [--options default no_s1_heal] [--workload rerank] \\
        --out F.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from planner_quality import OPTIONS, embedded

from irminsul.analysis.consistency import consistency
from irminsul.config import CacheConfig
from irminsul.studies.consistency import sample_pool, workload_requests
from irminsul.traffic.workloads import PATTERNS

NEAR_TIE = 0.05  # nats between the reference's top two tokens


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Steps, flips and near ties over the requests PIC or naive reuse served from the registry
    (the study's own scope)."""
    hit = [r for r in report["per_request"] if r["pic"]["pic_tokens"] or r["naive"]["pic_tokens"]]
    margins = [m for r in hit for m in r["pic"]["reference_margins"]]
    flips = [margin for r in hit for _, margin in r["pic"]["flips"]]
    near = sum(m < NEAR_TIE for m in margins)
    clear = len(margins) - near
    clear_flips = sum(m >= NEAR_TIE for m in flips)
    return {"steps": len(margins), "flips": len(flips), "near_tie_steps": near,
            "flips_at_near_ties": len(flips) - clear_flips,
            "flip_margins": sorted(flips),
            "argmax_pic": report["argmax_pic"], "kl_pic": report["kl_pic"],
            "argmax_beyond_near_ties": 1 - clear_flips / clear if clear else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--options", nargs="+", choices=list(OPTIONS),
                        default=["default", "no_s1_heal"])
    parser.add_argument("--workload", choices=list(PATTERNS), default="rerank")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=8, help="continuation tokens per request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, renderer, settings, meta = embedded(args, "argmax_margins")
    requests = workload_requests(args.workload, sample_pool(renderer), settings)
    out: dict[str, Any] = {
        "meta": meta, "workload": args.workload, "requests": args.requests, "tokens": args.tokens,
        "near_tie": NEAR_TIE, "options": {name: OPTIONS[name] for name in args.options},
        "rows": []}
    for name in args.options:
        cache = dataclasses.replace(CacheConfig(), **OPTIONS[name])
        report = consistency(model, renderer, requests, tokens=args.tokens, cache=cache,
                             heal=cache.heal)
        row = {"option": name, **summarize(report)}
        out["rows"].append(row)
        print(f"{name:11s} {args.workload}: {row['flips']} flips in {row['steps']} steps, "
              f"{row['flips_at_near_ties']} at near ties (of {row['near_tie_steps']}); argmax "
              f"{row['argmax_pic']:.3f}, beyond near ties {row['argmax_beyond_near_ties']:.3f}",
              flush=True)
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
