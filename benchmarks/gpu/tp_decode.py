"""Decode steps under tensor parallel against each rank's floor: the leader's engine over W ranks
(one process per GPU, NCCL; gloo on CPUs), random weights of a config's shapes made per rank
(``--keep-fp8``: float8 with block scales, as an FP8 checkpoint kept so), B requests of C tokens.

Each cell is benchmarks/gpu/decode.py's (``decode_cell``: contexts stubbed, steps back to back,
median interval), with the leader's engine, whose forwards every rank runs on its share. The
floor is rank 0's bytes over the measured copy bandwidth: its weight shares, the routed experts
of its own that the batch touches, and every KV row (each rank holds the whole latent pool);
the two all-reduces per layer are not in it, so step / floor shows what they and the launches
cost. Not run on a multi-GPU host yet.

    python benchmarks/gpu/tp_decode.py --config DeepSeek-V3/config.json --world 8 --keep-fp8 \\
        --out F.json
    python benchmarks/gpu/tp_decode.py --device cpu --tiny --world 2 --batches 1 2 \\
        --contexts 64 --out F.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
from typing import Any

import roofline
import torch
from common import model_config, run_metadata
from decode import decode_cell

from irminsul.config import ParallelConfig
from irminsul.engine import Engine
from irminsul.model import MLAModel, parse_config
from irminsul.model.random_weights import random_model
from irminsul.parallel import follow, init, leader_engine, release, shard_model, shutdown
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
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    def share(model: MLAModel) -> None:
        shard_weights(model, rank, args.world)

    model = random_model(parse_config(raw), device, dtype, keep_fp8=args.keep_fp8,
                         prepare=share)
    shard_model(model, group)
    if not group.leader:
        follow(model, group)
        shutdown()
        return
    out: dict[str, Any] = {"meta": run_metadata(device), "world": args.world,
                           "keep_fp8": args.keep_fp8, "config": args.config or (
                               "tiny" if args.tiny else "DeepSeek-V2-Lite"),
                           "copy_gbps": roofline.copy_bandwidth(device), "cells": []}
    opened: list[Engine] = []

    def make(model: MLAModel, config: Any) -> Engine:
        opened.append(leader_engine(model, config, group))
        return opened[-1]

    try:
        for context in args.contexts:
            for batch in args.batches:
                cell = decode_cell(model, batch, context, args.steps, args.warmup,
                                   out["copy_gbps"], make_engine=make)
                for engine in opened:  # the followers free their pools too
                    engine.close()
                opened.clear()
                out["cells"].append(cell)
                print(f"W {args.world}  context {context:>6}  batch {batch:>4}: step "
                      f"{cell['step_ms']:8.2f} ms  {cell['tokens_per_s']:9.0f} tok/s  floor "
                      f"{cell['floor_ms']:7.2f} ms  step/floor {cell['step_over_floor']:5.2f}",
                      flush=True)
                with open(args.out, "w", encoding="utf-8") as f:
                    json.dump(out, f, indent=1)
    except BaseException as err:
        release(group, f"{type(err).__name__}: {err}")
        raise
    release(group)
    shutdown()
    results.put(len(out["cells"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--world", type=int, default=2, help="ranks (GPUs)")
    parser.add_argument("--config", help="a config.json (default: DeepSeek-V2-Lite's shapes)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (CPU smoke)")
    parser.add_argument("--keep-fp8", action="store_true",
                        help="float8 weights with block scales (the config's block, else 128)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
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
        raise SystemExit(f"tensor-parallel decode failed: rank exit codes {codes}")


if __name__ == "__main__":
    main()
