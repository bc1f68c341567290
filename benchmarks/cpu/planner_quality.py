"""What each planner option's reuse costs in output quality: live PIC's consistency per option.

The planner finds moved content in three ways beyond whole chunks (docs/design.md): the 32-token
sub-windows of a missed chunk (``CacheConfig.s1``: repeats inside otherwise new messages), the
head probe (``head_probe``) and runs of registered regions (``regions``). Each finds more
reusable tokens; the ones found inside new messages were computed after other text than the
text now before them. For each option and workload (the consistency study's, built from the
shipped samples) this runs ``irminsul consistency``'s measurement: a live PIC engine and a
naive-reuse engine against full recomputation, KL(full ‖ served) and greedy argmax match over a
teacher-forced continuation (means over the requests with registry hits), and the share of
prompt tokens PIC served. The embedded model in float32 on the CPU.

    python benchmarks/cpu/planner_quality.py [--options default no_s1 no_s1_head]
        [--workloads rerank compact tool_variants] [--requests 12] [--tokens 8] --out F.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from typing import Any

import torch

from irminsul.analysis.consistency import consistency
from irminsul.config import CacheConfig
from irminsul.model import MLAModel, default_model_dir, load_model
from irminsul.studies.consistency import ConsistencySettings, sample_pool, workload_requests
from irminsul.traffic.render import ChatRenderer
from irminsul.traffic.workloads import PATTERNS

OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "no_s1": {"s1": False},
    "no_s1_head": {"s1": False, "head_probe": False},
    "no_regions": {"regions": False},
    "heal": {"heal": True},
    "no_s1_heal": {"s1": False, "heal": True},
}
FIGURES = ("kl_pic", "argmax_pic", "kl_naive", "argmax_naive", "pic_token_fraction",
           "requests_with_hits")


def embedded(args: argparse.Namespace, script: str
             ) -> tuple[MLAModel, ChatRenderer, ConsistencySettings, dict[str, Any]]:
    """The embedded model in float32 on ``args.threads`` threads, its renderer, the study's
    settings for ``args.requests`` and ``args.tokens``, and a results file's meta (the command
    as ``benchmarks/cpu/SCRIPT.py`` was run)."""
    torch.set_num_threads(args.threads)
    model_dir = default_model_dir()
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
            "threads": args.threads, "model": "embedded default, float32",
            "command": " ".join([f"python benchmarks/cpu/{script}.py", *sys.argv[1:]])}
    return (load_model(model_dir, dtype=torch.float32), ChatRenderer.from_dir(model_dir),
            ConsistencySettings(requests=args.requests, tokens=args.tokens), meta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--options", nargs="+", choices=list(OPTIONS),
                        default=["default", "no_s1", "no_s1_head"])
    parser.add_argument("--workloads", nargs="+", choices=list(PATTERNS),
                        default=["rerank", "compact", "tool_variants"])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=8, help="continuation tokens per request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, renderer, settings, meta = embedded(args, "planner_quality")
    pool = sample_pool(renderer)
    out: dict[str, Any] = {
        "meta": meta, "options": {name: OPTIONS[name] for name in args.options},
        "requests": args.requests, "tokens": args.tokens, "rows": []}
    for name in args.options:
        cache = dataclasses.replace(CacheConfig(), **OPTIONS[name])
        for pattern in args.workloads:
            started = time.perf_counter()
            report = consistency(model, renderer, workload_requests(pattern, pool, settings),
                                 tokens=args.tokens, cache=cache, heal=cache.heal)
            row = {"option": name, "workload": pattern, **{k: report[k] for k in FIGURES},
                   "seconds": time.perf_counter() - started}
            out["rows"].append(row)
            print(f"{name:11s} {pattern:14s} KL PIC {row['kl_pic']:.5f} argmax "
                  f"{row['argmax_pic']:.3f} PIC tokens {row['pic_token_fraction']:.1%}",
                  flush=True)
            with open(args.out, "w", encoding="utf-8") as fh:
                json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
