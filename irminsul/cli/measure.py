"""The commands that run a model to measure it: consistency, study and the gate."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from ..config import GateConfig
from ..traffic.logs import read_requests
from .common import (
    ENGINE,
    GATE,
    add_command,
    built_workloads,
    device_options,
    model_dir_of,
    model_renderer,
    model_workload_options,
    positive,
    repair_cache,
    repair_options,
    write_json,
)


def cmd_consistency(args: argparse.Namespace) -> None:
    """Output consistency of PIC and naive reuse against full recomputation on a request log."""
    from itertools import islice

    # torch and the model runtime load only here, so the other commands start fast without them.
    import torch

    from ..analysis.consistency import consistency, render_consistency
    from ..engine import PoolExhausted
    from ..model import load_model

    renderer = model_renderer(args)
    model = load_model(model_dir_of(args), dtype=getattr(torch, args.dtype), device=args.device)
    with built_workloads(args, renderer) as (log,):
        requests = islice(read_requests(log), args.requests)
        try:
            report = consistency(model, renderer, requests, tokens=args.tokens,
                                 num_slots=args.slots, heal=args.heal,
                                 progress=not args.quiet)
        except PoolExhausted as err:
            raise ValueError(f"{err}; give the engines more --slots") from err
    print(render_consistency(report))
    write_json(args.json, [report])


def cmd_study(args: argparse.Namespace) -> None:
    """Run one of the paper's studies; print its key figures, write <study>.json and .png."""
    import torch

    from ..studies.run import run_study

    options = {"roc": {"blocks": args.blocks, "seed": args.seed},
               "sink": {"samples": args.samples, "reuse_samples": args.reuse_samples,
                        "repair_head": args.repair_head, "repair_share": args.repair_share,
                        "repair_check_layer": args.repair_check_layer, "seed": args.seed},
               "consistency": {"requests": args.requests, "tokens": args.tokens,
                               "seed": args.seed, "heal": args.heal},
               "hijack": {"documents": args.documents, "tokens": args.tokens,
                          "seed": args.seed}}[args.study]
    out = Path(args.out)
    text, _ = run_study(args.study, model_dir_of(args), out, options=options,
                        dtype=getattr(torch, args.dtype), device=args.device,
                        progress=not args.quiet)
    print(text)
    print(f"wrote {out / (args.study + '.json')} and {out / (args.study + '.png')}")


def cmd_gate(args: argparse.Namespace) -> int:
    """The PIC correctness gate on a checkpoint: exit status 0 if it passes, 1 if refused."""
    if args.tokenizer:
        # The gate measures the checkpoint on its own tokens, as the server renders them.
        raise ValueError("gate renders the probes with the model directory's tokenizer and chat "
                         "template; --tokenizer does not apply to it")
    import torch

    from ..model import load_model
    from ..quality import checkpoint_hash, run_gate
    from ..quality.report import render_gate

    model_dir = model_dir_of(args)
    renderer = model_renderer(args)
    model = load_model(model_dir, dtype=getattr(torch, args.dtype), device=args.device)
    config = GateConfig(tokens=args.tokens, cache_dir=args.cache_dir)
    # Repair changes what is served, so the gate measures the engine as it would serve: the
    # measurement is cached per setting (the planner config is part of the key).
    engine = dataclasses.replace(ENGINE, cache=repair_cache(args))
    result = run_gate(model, renderer, checkpoint_hash(model_dir), config, engine=engine,
                      fresh=args.fresh)
    print(render_gate(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=1), encoding="utf-8")
    return 0 if result.passed else 1


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add consistency, gate and study to the ``irminsul`` subparsers ``sub``."""
    check = add_command(sub, "consistency",
                     "KL, argmax-match and first divergence of PIC and naive reuse against full "
                     "recomputation")
    model_workload_options(check, many=False)
    check.add_argument("--tokens", type=positive, default=16,
                       help="continuation tokens per request (default 16)")
    _heal_option(check)
    check.set_defaults(func=cmd_consistency)

    gate = add_command(sub, "gate", "the PIC correctness gate: KL and argmax of PIC and naive reuse "
                                 "against full recomputation on the shipped probes; exit 0 pass, "
                                 "1 refused", tokenizer=False)
    gate.add_argument("--json", metavar="OUT", help="write the result as JSON")
    gate.add_argument("--tokens", type=int, default=GATE.tokens,
                      help=f"continuation tokens per probe (default {GATE.tokens})")
    gate.add_argument("--fresh", action="store_true",
                      help="measure again even if the result cache holds this checkpoint")
    gate.add_argument("--cache-dir", metavar="DIR", default=GATE.cache_dir,
                      help="where results are cached per checkpoint hash (default "
                           "$XDG_CACHE_HOME/irminsul/gate, else ~/.cache/irminsul/gate)")
    repair_options(gate)
    _run_model_options(gate)
    gate.set_defaults(func=cmd_gate)

    study = add_command(sub, "study", "the paper's studies on a model: position-invariance AUC "
                                   "(roc), attention sink and carve-out (sink), output "
                                   "consistency over the five workloads (consistency), KV "
                                   "hijacking by a document registered behind an injection (hijack)")
    study.add_argument("study", choices=("roc", "sink", "consistency", "hijack"),
                       help="roc: AUC of c_KV, k_r and the row per layer (§5); sink: W and S "
                            "by chunk position and tail mass to [0, 32) under PIC, naive and "
                            "fresh (§7.1); consistency: Table 2 over the five workloads; "
                            "hijack: a clean prompt served a document registered behind an "
                            "adversarial preamble, with and without cache_salt and repair")
    study.add_argument("--out", default=".", metavar="DIR",
                       help="where to write <study>.json and <study>.png (default: .)")
    study.add_argument("--blocks", type=int, default=None,
                       help="roc: content blocks (default 32; the paper's is 500)")
    study.add_argument("--samples", type=int, default=None,
                       help="sink: chunks per position (default 4; the paper's is 20)")
    study.add_argument("--reuse-samples", type=int, default=None,
                       help="sink: target prompts of the carve-out measurement (default 8)")
    study.add_argument("--repair-head", type=int, default=None, metavar="K",
                       help="sink: the EPIC path computes the reused body's first K tokens "
                            "(default 32)")
    study.add_argument("--repair-share", type=float, default=None, metavar="R",
                       help="sink: the CacheBlend path computes this share of the body "
                            "(default 0.1)")
    study.add_argument("--repair-check-layer", type=int, default=None, metavar="N",
                       help="sink: the CacheBlend path picks by c_KV deviation at layer N "
                            "(default 1)")
    study.add_argument("--requests", type=int, default=None,
                       help="consistency: requests per workload (default 3)")
    study.add_argument("--tokens", type=int, default=None,
                       help="consistency, hijack: continuation tokens per request (default 8; "
                            "hijack 16)")
    study.add_argument("--documents", type=int, default=None,
                       help="hijack: documents, each behind one of three preambles (default 12)")
    study.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    _heal_option(study)
    _run_model_options(study)
    study.set_defaults(func=cmd_study)


def _heal_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heal", action="store_true",
                        help="consistency: the engines heal between requests (serve --heal on a "
                             "server with idle time between an agent's turns)")


def _run_model_options(parser: argparse.ArgumentParser) -> None:
    """The model a measuring command (gate, study) runs, and where."""
    parser.add_argument("--model", metavar="DIR|REPO",
                        help="Hugging Face checkpoint directory or Hub repo id[@revision] "
                             "(default: the embedded default model)")
    device_options(parser)
