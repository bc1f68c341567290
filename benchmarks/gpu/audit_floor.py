"""The live-PIC audit's floor: what it reads for requests served with no reuse at all.

The audit (``irminsul serve --pic-audit-rate``) recomputes a served request and records
KL(full ‖ served) of the first token. The served logits come from the engine's own path
(Triton kernels, attention read from the pool, CUDA graphs where they replay). With nothing
reused the reference should agree with them, so their KL here is the floor under every figure
the audit exports: the part of it that is arithmetic, not reuse. Two references:

    plain   ``Engine.recompute``: the model's plain forward outside the pool (the audit's
            reference until 2026-12-07)
    pool    ``Engine.recompute_in_pool``: a prefill through the engine's own path in a namespace
            nothing else uses (the audit's reference now)

Per model and prompt length, ``--prompts`` prompts of real agent text (the shipped samples'
distinct messages back to back in the embedded model's tokenizer, folded into the vocabulary
of random weights), each prefilled in a namespace of its own (nothing to reuse)
by an engine with PIC off, against each reference: KL median / p90 / max.

    python benchmarks/gpu/audit_floor.py --out F.json
    python benchmarks/gpu/audit_floor.py --device cpu --models default --lengths 64 --out F
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch
from common import build_model, run_metadata

from irminsul.config import EngineConfig
from irminsul.engine import Engine
from irminsul.engine.audit import kl_per_step
from irminsul.model import MLAModel, load_model
from irminsul.model.default import default_model_dir
from irminsul.traffic.logs import sample_logs
from irminsul.traffic.prompt import distinct_messages
from irminsul.traffic.render import ChatRenderer


def _text(vocab: int) -> np.ndarray:
    """The samples' distinct messages in the embedded model's tokenizer (random weights: any
    real text does), ids folded into ``vocab``."""
    renderer = ChatRenderer.from_dir(default_model_dir())
    return np.concatenate(distinct_messages(renderer, sample_logs())).astype(np.int64) % vocab


def floor(model: MLAModel, text: np.ndarray, length: int, prompts: int
          ) -> dict[str, dict[str, float]]:
    """Per reference, KL(reference ‖ served) over ``prompts`` prompts of ``length`` tokens
    served with nothing reused."""
    engine = Engine(model, EngineConfig(slots=2 * length + 64, mode="off"))
    references = {"plain": engine.recompute,
                  "pool": lambda prompt: engine.recompute_in_pool(prompt, prompt.size)}
    values: dict[str, list[float]] = {name: [] for name in references}
    for i in range(prompts):
        start = (i * 997 * length) % max(1, text.size - length)
        prompt = text[start:start + length]
        seq, served = engine.prefill(prompt, namespace=i + 1)
        engine.finish(seq, remember=False)
        for name, reference in references.items():
            full = reference(prompt)
            values[name].append(float(kl_per_step(full[None], served[None].to(full.device))[0]))
    engine.close()
    out = {}
    for name, kls in values.items():
        kls.sort()
        out[name] = {"kl_median": statistics.median(kls), "kl_p90": kls[int(0.9 * (len(kls) - 1))],
                     "kl_max": kls[-1]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", nargs="+", default=["default", "v2-lite-random"],
                        choices=["default", "v2-lite-random"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    result = {"meta": run_metadata(args.device), "cells": []}
    for name in args.models:
        model = (load_model(default_model_dir(), dtype=dtype, device=args.device)
                 if name == "default" else build_model(args.device))
        text = _text(model.config.vocab_size)
        for length in args.lengths:
            cell = {"model": name, "prompt_tokens": length, "prompts": args.prompts,
                    **floor(model, text, length, args.prompts)}
            result["cells"].append(cell)
            for ref in ("plain", "pool"):
                print(f"{name:>15} {length:6d} tokens, {ref:>5}: KL median "
                      f"{cell[ref]['kl_median']:.2e}  p90 {cell[ref]['kl_p90']:.2e}  "
                      f"max {cell[ref]['kl_max']:.2e}", flush=True)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
