"""The GPU suite under tensor parallel: decode steps against each rank's floor, and agent_meta
TTFT with PIC off / live / ideal, through the leader's engine over W ranks (one process per GPU,
NCCL; gloo on CPUs), random weights of a config's shapes made per rank (``--keep-fp8``: float8
with block scales, as an FP8 checkpoint kept so; ``--layers N``: the config's first N layers, for
a model that does not fit the host whole).

decode: each cell is benchmarks/gpu/decode.py's (``decode_cell``: B requests of C tokens,
contexts stubbed, steps back to back, median interval), with the leader's engine, whose forwards
every rank runs on its share. The floor is rank 0's bytes over the measured copy bandwidth: its
weight shares, the routed experts of its own that the batch touches, and every KV row (each rank
holds the whole latent pool); the two all-reduces per layer are not in it, so step / floor shows
what they and the launches cost. Eager forwards unless ``--graphs``: every rank then captures
and replays CUDA graphs (bfloat16 or FP8-kept weights, 16 heads a rank or a multiple; under
``--attention data`` the exchanges in fixed sizes), not yet run on several GPUs.

``--attention data``: data-parallel attention instead (each rank every head and its own
requests, the routed experts split and reached by all-to-all: irminsul.parallel.dispatch). Every
rank then runs the same cells on its own lockstep engine (irminsul.parallel.lockstep) with its own
copy of the cell's requests: a decode cell of batch B is B requests on each rank, W·B on the node
(``node_tokens_per_s``), and a TTFT request is served while every other rank serves its own
copy. The floor is still rank 0's bytes: its whole attention and dense weights, its experts that
any rank's tokens touch, its own requests' KV rows.

ttft: each cell is benchmarks/gpu/ttft.py's (``ttft_cell``: agent_meta requests, a changed
header of H tokens before a shared body, at L tokens; no cache / exact prefix / PIC live /
ideal), every mode's engine the leader's.

    python benchmarks/gpu/tp_suite.py --config DeepSeek-V3/config.json --world 8 --keep-fp8 \\
        --out F.json
    python benchmarks/gpu/tp_suite.py --config DeepSeek-V3/config.json --world 8 --keep-fp8 \\
        --attention data --out F.json
    python benchmarks/gpu/tp_suite.py --device cpu --tiny --world 2 --batches 1 2 \\
        --contexts 64 --lengths 256 --out F.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
from typing import Any

import roofline
import torch
from common import AgentText, model_config, run_metadata
from decode import decode_cell
from shift_prompts import build_requests
from ttft import MODES, ttft_cell

from irminsul.config import ParallelConfig
from irminsul.engine import Engine
from irminsul.model import MLAModel, parse_config
from irminsul.model.random_weights import random_model
from irminsul.parallel import follow, init, leader_engine, release, shard_model, shutdown
from irminsul.parallel.lockstep import lockstep_engine
from irminsul.parallel.ranks import free_address
from irminsul.parallel.shard import shard_weights


def _rank(rank: int, args: argparse.Namespace, address: str, results: mp.Queue) -> None:
    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // args.world))
    group = init(rank, ParallelConfig(world_size=args.world, timeout_s=600.0), address,
                 device=device)
    raw = json.load(open(args.config, encoding="utf-8")) if args.config else model_config(
        args.tiny)
    if args.layers:
        raw = dict(raw, num_hidden_layers=args.layers)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    data = args.attention == "data"

    def share(model: MLAModel) -> None:
        shard_weights(model, rank, args.world, args.attention)

    model = random_model(parse_config(raw), device, dtype, keep_fp8=args.keep_fp8,
                         prepare=share)
    shard_model(model, group, args.attention)
    if not group.leader and not data:
        follow(model, group)
        shutdown()
        return
    out: dict[str, Any] = {"meta": run_metadata(device), "world": args.world,
                           "attention": args.attention,
                           "keep_fp8": args.keep_fp8, "graphs": args.graphs,
                           "config": args.config or (
                               "tiny" if args.tiny else "DeepSeek-V2-Lite"),
                           "layers": raw["num_hidden_layers"],
                           "copy_gbps": roofline.copy_bandwidth(device), "cells": [],
                           "ttft": []}

    def lead(model: MLAModel, config: Any) -> Engine:  # every cell closes the engines it opens
        if args.graphs:
            config = dataclasses.replace(config, graphs=True)
        if data:  # every rank its own engine, in lockstep with the others'
            return lockstep_engine(model, config, group)
        return leader_engine(model, config, group)

    def save() -> None:
        if group.leader:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=1)

    def ttft() -> None:
        text = AgentText(model.config.vocab_size)
        # A discarded cell first: Triton compiles its kernels' variants on first use.
        ttft_cell(model, build_requests("agent_meta", text, min(args.lengths), 3, seed=1), 1,
                  make_engine=lead)
        for length in args.lengths:
            requests = build_requests("agent_meta", text, length,
                                      args.requests + args.ttft_warmup, header=args.header,
                                      seed=length)
            cell = {"pattern": "agent_meta", "header_tokens": args.header,
                    **ttft_cell(model, requests, args.ttft_warmup, make_engine=lead)}
            out["ttft"].append(cell)
            if group.leader:
                    print(f"W {args.world}  agent_meta L={length:>6} H={args.header}: served "
                      f"{100 * cell['served']['PIC live']:5.1f}%  "
                      + "  ".join(f"{m} {cell[m]['p50_ms']:8.1f}" for m in MODES)
                      + f"  live/ideal {cell['live_over_ideal']:.2f}x", flush=True)
            save()

    def decode() -> None:
        for context in args.contexts:
            for batch in args.batches:
                profile = f"{batch}x{context}" if [batch, context] in args.profile else None
                cell = decode_cell(model, batch, context, args.steps, args.warmup,
                                   out["copy_gbps"], profile, make_engine=lead)
                cell["node_tokens_per_s"] = cell["tokens_per_s"] * (args.world if data else 1)
                out["cells"].append(cell)
                if group.leader:
                    print(f"W {args.world}  context {context:>6}  batch {batch:>4}"
                          f"{' a rank' if data else ''}: step {cell['step_ms']:8.2f} ms  "
                          f"{cell['node_tokens_per_s']:9.0f} tok/s  floor "
                          f"{cell['floor_ms']:7.2f} ms  step/floor "
                          f"{cell['step_over_floor']:5.2f}", flush=True)
                save()

    try:
        for section in args.sections:  # in the order given
            {"ttft": ttft, "decode": decode}[section]()
    except BaseException as err:
        if not data:
            release(group, f"{type(err).__name__}: {err}")
        raise
    if not data:
        release(group)
    shutdown()
    results.put(len(out["cells"]) + len(out["ttft"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--world", type=int, default=2, help="ranks (GPUs)")
    parser.add_argument("--config", help="a config.json (default: DeepSeek-V2-Lite's shapes)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (CPU smoke)")
    parser.add_argument("--attention", choices=("tensor", "data"), default="tensor",
                        help="heads split over the ranks (tensor), or requests (data)")
    parser.add_argument("--keep-fp8", action="store_true",
                        help="float8 weights with block scales (the config's block, else 128)")
    parser.add_argument("--layers", type=int, help="the config's first N layers only")
    parser.add_argument("--graphs", action="store_true",
                        help="CUDA graphs on every rank (default: eager forwards)")
    parser.add_argument("--sections", nargs="+", choices=("decode", "ttft"),
                        default=["decode", "ttft"], help="what to run, in this order")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536],
                        help="TTFT prompt lengths (tokens)")
    parser.add_argument("--header", type=int, default=50, help="agent_meta's changed header")
    parser.add_argument("--requests", type=int, default=4, help="timed requests per TTFT cell")
    parser.add_argument("--ttft-warmup", type=int, default=2,
                        help="requests per TTFT cell first, untimed (they fill the caches)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--profile", type=int, nargs=2, action="append", default=[],
                        metavar=("BATCH", "CONTEXT"),
                        help="also profile this decode cell's steps on rank 0 (repeatable)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps per cell first")
    parser.add_argument("--out", required=True, help="results JSON")
    args = parser.parse_args()
    address = free_address()
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, args, address, results))
             for r in range(args.world)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
    codes = [p.exitcode for p in ranks]
    if any(codes) or results.empty():
        raise SystemExit(f"{args.attention}-parallel suite failed: rank exit codes {codes}")


if __name__ == "__main__":
    main()
