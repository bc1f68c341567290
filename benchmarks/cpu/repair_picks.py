"""Which reused tokens the gradient oracle of ``repair.py`` picks, against what other rankings
would pick.

For each request of a workload with at least 20 reused tokens (served in order by a live engine,
as ``repair.py`` serves them): every reused token's first-order effect on KL(full ‖ served) (the
gradient oracle), its deviation at every layer (the deviation oracle) and the attention it
receives from the prompt's last 17 tokens in a full forward, per layer. Printed per request: the
share of reused tokens whose effect is negative (recomputing them alone would raise KL), the
share of the positive effect the top tenth by gradient holds, and how much of that top tenth
each other ranking's top tenth shares.

    python benchmarks/cpu/repair_picks.py [--workload sysvar] [--requests 4] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from common import run_metadata  # noqa: E402
from repair import gradient_deviation, oracle_deviation  # noqa: E402

from irminsul.analysis.consistency import full_continuation, render_prompts, serve  # noqa: E402
from irminsul.config import CacheConfig, EngineConfig  # noqa: E402
from irminsul.engine import Engine  # noqa: E402
from irminsul.loadgen.workloads import load_workload  # noqa: E402
from irminsul.model import default_model_dir, load_model  # noqa: E402
from irminsul.studies.attention import AttentionProbe  # noqa: E402
from irminsul.traffic.render import ChatRenderer  # noqa: E402
from irminsul.traffic.workloads import PATTERNS  # noqa: E402


def top_overlap(score: np.ndarray, top: set[int], k: int) -> float:
    """The share of ``top`` (k indices) among the k largest of ``score``."""
    return len(set(np.argsort(-score)[:k].tolist()) & top) / k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="sysvar", choices=PATTERNS)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16, help="continuation tokens")
    parser.add_argument("--out", help="results JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    directory = default_model_dir()
    model, renderer = load_model(directory, dtype=torch.float32), ChatRenderer.from_dir(directory)
    chosen = load_workload(args.workload, renderer)[:args.requests]
    prompts = render_prompts(renderer, chosen, model.config.vocab_size)
    references = [full_continuation(model, p.tokens, args.tokens) for _, p in prompts]
    # Any share > 0 runs the check on every request with reuse. ``record`` returns 0 for every
    # token, so the 5% recomputed are each request's earliest reused tokens (ties go to the
    # earlier position), which later requests then match as computed rows.
    engine = Engine(model, EngineConfig(slots=sum(p.size + 2 * args.tokens for _, p in prompts),
                                        mode="live", cache=CacheConfig(recompute_share=0.05)))
    gradient_deviation(model, engine, {p.tokens.astype(np.int64).tobytes(): r
                                       for (_, p), r in zip(prompts, references)})
    gradient = engine.cache.latent_check
    oracle_deviation(model, engine)
    deviation = engine.cache.latent_check
    seen: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    def record(prompt: Any, positions: Any, slots: Any) -> Any:
        seen.append((np.asarray(prompt).copy(), positions.copy(),
                     gradient(prompt, positions, slots), deviation(prompt, positions, slots)))
        return np.zeros(len(positions))

    engine.cache.latent_check = record
    for (_, prompt), (continuation, logits) in zip(prompts, references):
        serve(engine, prompt, continuation, logits)
    rows = []
    for prompt, positions, effect, size in seen:
        if positions.size < 20:
            continue
        k = positions.size // 10
        top = set(np.argsort(-effect)[:k].tolist())
        with AttentionProbe(model) as probe:
            model.forward(torch.as_tensor(prompt, dtype=torch.long), torch.arange(prompt.size))
        received = np.stack([layer[:, -17:, :].mean((0, 1)).numpy() for layer in probe.layers])
        received = received[:, positions]
        rows.append({"reused": int(positions.size),
                     "negative_share": float((effect < 0).mean()),
                     "top_tenth_share_of_positive_effect":
                         float(np.sort(effect)[::-1][:k].sum() / effect[effect > 0].sum()),
                     "overlap_deviation_oracle": top_overlap(size, top, k),
                     "overlap_attention_per_layer": [top_overlap(r, top, k) for r in received]})
        print(json.dumps(rows[-1]))
    if args.out:
        Path(args.out).write_text(json.dumps({"workload": args.workload, "rows": rows,
                                              "meta": run_metadata("cpu")}, indent=1),
                                  encoding="utf-8")


if __name__ == "__main__":
    main()
