"""Repair on the latent: what recomputing the first k tokens of every reused run buys.

EPIC-style repair (``CacheConfig.recompute_head``): a reused run's first tokens are computed in
this prompt's context instead of reused, the rest of the run still reused with k_r rotated by δ.
For each k, every request of a workload is served by a persistent live engine (so each request
sees what the earlier ones registered, as in serving) and compared with full recomputation, as
``irminsul consistency`` does: KL(full ‖ served) and argmax match over a teacher-forced
continuation, and the first divergence of free-running greedy decoding; beside them the share
of the reused tokens that repair computed instead. Over the requests whose prompt got a
registry hit at k = 0. The model is the embedded default unless ``--model`` names a checkpoint.

    python benchmarks/cpu/repair.py [--heads 0 2 4 8 16 32] [--requests 12] [--tokens 16]
                                    [--model DIR] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from common import run_metadata  # noqa: E402

from irminsul.analysis.consistency import full_continuation, render_prompts, serve  # noqa: E402
from irminsul.config import CacheConfig, EngineConfig  # noqa: E402
from irminsul.engine import Engine  # noqa: E402
from irminsul.loadgen.workloads import load_workload  # noqa: E402
from irminsul.model import default_model_dir, load_model  # noqa: E402
from irminsul.traffic.render import ChatRenderer  # noqa: E402


def measure(model_dir: Path, heads: list[int], requests: int, tokens: int,
            workload: str) -> dict[str, Any]:
    """Per k: mean KL, argmax match, first divergence over the hit requests, and the share of
    the unrepaired reused tokens computed instead."""
    model = load_model(model_dir, dtype=torch.float32, device="cpu")
    renderer = ChatRenderer.from_dir(model_dir)
    chosen = load_workload(workload, renderer)[:requests]
    prompts = render_prompts(renderer, chosen, model.config.vocab_size)
    references = [full_continuation(model, p.tokens, tokens) for _, p in prompts]
    slots = sum(p.size + 2 * tokens for _, p in prompts)
    rows = []
    for k in heads:
        engine = Engine(model, EngineConfig(slots=slots, mode="live",
                                            cache=CacheConfig(recompute_head=k)))
        served = [serve(engine, p, c, logits) for (_, p), (c, logits) in zip(prompts, references)]
        engine.check()
        rows.append({"recompute_head": k, "served": served})
    hit = [i for i, s in enumerate(rows[0]["served"]) if s["pic_tokens"]]
    reused = sum(rows[0]["served"][i]["pic_tokens"] for i in hit)
    out = []
    for row in rows:
        picked = [row["served"][i] for i in hit]
        out.append({"recompute_head": row["recompute_head"],
                    "recomputed_share": (1 - sum(s["pic_tokens"] for s in picked) / reused)
                    if reused else 0.0,
                    "kl": statistics.fmean(s["kl"] for s in picked) if picked else None,
                    "argmax": statistics.fmean(s["argmax"] for s in picked) if picked else None,
                    "first_divergence": statistics.fmean(s["first_divergence"] for s in picked)
                    if picked else None})
    return {"workload": workload, "requests": len(prompts), "requests_with_hits": len(hit),
            "reused_tokens": reused, "tokens": tokens, "model": str(model_dir), "rows": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[0, 2, 4, 8, 16, 32],
                        help="values of recompute_head (k)")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=16, help="continuation tokens")
    parser.add_argument("--workload", default="agent_meta",
                        help="a bench serve workload name (irminsul.loadgen.workloads)")
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--out", help="results JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.model or default_model_dir(), args.heads, args.requests, args.tokens,
                     args.workload)
    result["meta"] = run_metadata("cpu")
    print(f"{result['workload']}: {result['requests']} requests, {result['requests_with_hits']} "
          f"with hits, {result['reused_tokens']} reused tokens without repair")
    print(f"{'k':>4} {'recomputed':>11} {'KL(full||PIC)':>14} {'argmax':>8} {'first div.':>11}")
    for r in result["rows"]:
        print(f"{r['recompute_head']:>4} {r['recomputed_share']:>10.1%} {r['kl']:>14.3e} "
              f"{r['argmax']:>8.3f} {r['first_divergence']:>11.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
