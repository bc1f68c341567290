"""Decode steps against their memory floor: the serving path's step time at batch B, context C.

B requests, each with its own C-token context (random ids, PIC off: nothing shared), all
decoding; a step is one ``Scheduler.step`` (batching, the forward, sampling), timed as the
interval between consecutive steps' returns, steps run back to back as a serving loop runs them
(a greedy step's forward is launched before the host reports the step before it), median over
the timed steps. The contexts are not computed:
their prefill forwards are replaced by a stub that returns random logits and the KV rows are
filled with noise (attention costs the same over any rows), so a 128 × 16K cell takes seconds.

The floor is the bytes a step must read over the measured copy bandwidth: every weight but the
routed experts and the embedding table, the routed experts the batch's tokens touch (counted per
layer on one extra step by a hook on each router), one embedding row per token, and every
request's KV rows (c_KV and k_r, every layer).

A second figure says what a step of many small kernels cannot go below: the device kernels one
step runs (counted by torch.profiler over a few steps, graph replays included) times the device
time of the smallest kernel, one that stores a single value, replayed back to back from a CUDA
graph (:func:`launch_us`) — a small step's kernels each pay that ramp, whatever their bytes.

    python benchmarks/gpu/decode.py --out docs/results/gpu-decode.json
    python benchmarks/gpu/decode.py --batches 64 --contexts 4096 --profile 64 4096 --out F
    python benchmarks/gpu/decode.py --batches 1 8 --arms engine shared-last launch.MODE=0 --out F
    python benchmarks/gpu/decode.py --device cpu --tiny --batches 1 2 --contexts 64 --out F
"""

from __future__ import annotations

import argparse
import ast
import importlib
import itertools
import json
import statistics
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import roofline
import torch
from common import build_model, run_metadata, sync

from irminsul.config import EngineConfig
from irminsul.engine import Engine, SamplingParams, Scheduler
from irminsul.model import MLAModel


def _element_bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def weight_bytes(model: MLAModel) -> tuple[int, int, int]:
    """(bytes of the weights every step reads, bytes of one routed expert, embedding row bytes):
    all parameters but the stacked routed experts and the embedding table."""
    experts = always = 0
    expert_bytes = 0
    for name, p in model.named_parameters():
        if name.endswith(("w13", "w2")):
            experts += _element_bytes(p)
            expert_bytes += _element_bytes(p[0])
        elif "embed_tokens" not in name:
            always += _element_bytes(p)
    embedding = model.config.hidden_size * next(model.parameters()).element_size()
    # expert_bytes sums one expert of each MoE layer: per layer it is the same size.
    moe_layers = sum(model.config.is_moe_layer(i) for i in range(model.config.num_hidden_layers))
    return always, expert_bytes // max(1, moe_layers), embedding


def kv_row_bytes(model: MLAModel) -> int:
    """Bytes of one token's KV rows over all layers (c_KV and k_r)."""
    cfg = model.config
    element = next(model.parameters()).element_size()
    return cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * element


def _stub_forward(scheduler: Scheduler, vocab: int):
    """Replace the runner's forward by random logits (the prefill stub); returns the undo."""
    runner = scheduler.engine.runner
    device = scheduler.engine.pool.ckv.device

    def noise(batch, *, all_logits: bool = False) -> list[torch.Tensor]:
        # Random logits: each request's first token differs, as its route through the experts.
        return [torch.randn(len(at) if all_logits else 1, vocab, device=device)
                for at in batch.positions]

    runner.forward = noise
    return lambda: delattr(runner, "forward")


def touched_experts(scheduler: Scheduler) -> float:
    """Distinct routed experts per MoE layer that one step's tokens touch (mean over layers),
    counted by hooks on the routers during one eager step (a replayed graph runs no hooks)."""
    model, runner = scheduler.engine.model, scheduler.engine.runner
    counts: list[int] = []
    # Ids from E on are the shared MLP folded into the fused MoE as experts (its bytes are
    # counted with the always-read weights): not routed experts.
    # Under expert parallel (benchmarks/gpu/tp_decode.py) a rank reads its own experts only:
    # ids first .. first + local - 1.
    # Under data-parallel attention a rank's router sees its own tokens only, and its experts
    # run the rows every rank dispatches to them: counted where they run (local_experts).
    def hook(moe):
        first = moe.expert_first or 0
        local = moe.w13.shape[0]
        return lambda m, _inp, out: counts.append(int(
            out[1][(out[1] >= first) & (out[1] < first + local)].unique().numel()))

    def recording(moe):
        run = moe.local_experts

        def local_experts(rows, ids):
            counts.append(int(ids.unique().numel()))
            return run(rows, ids)
        return local_experts

    moes = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    hooks = [moe.gate.register_forward_hook(hook(moe)) for moe in moes
             if getattr(moe, "dispatch", None) is None]
    for moe in moes:
        if getattr(moe, "dispatch", None) is not None:
            moe.local_experts = recording(moe)
    graphs, runner.graphs = runner.graphs, None
    try:
        # Two steps: the first may only land a step launched ahead (no forward of its own);
        # without graphs nothing is launched ahead, so the second runs the routers.
        for _ in range(2):
            _check(scheduler.step(), len(scheduler.running))
    finally:
        runner.graphs = graphs
        for hook in hooks:
            hook.remove()
        for moe in moes:
            moe.__dict__.pop("local_experts", None)
    return statistics.mean(counts) if counts else 0.0


def _check(outputs: list, batch: int) -> None:
    errors = [o.error for o in outputs if o.error]
    if errors or sum(len(o.new_tokens) for o in outputs) != batch:
        raise RuntimeError(f"{batch} requests, {sum(len(o.new_tokens) for o in outputs)} "
                           f"tokens; errors: {errors[:2]}")


def decode_cell(model: MLAModel, batch: int, context: int, steps: int, warmup: int,
                copy_gbps: float, profile: str | None = None,
                make_engine: Callable[..., Engine] = Engine) -> dict[str, Any]:
    """One (batch, context) cell: median step time, tokens/s, floor and their ratio.
    ``make_engine``: builds the engine (tensor parallel's leader: over its shard, on every
    rank; the floor is then this rank's bytes)."""
    device = str(next(model.parameters()).device)
    vocab = model.config.vocab_size
    # Room for the touched-experts step, a profile's 5 steps, and the tokens the requests whose
    # prefill completed first decode while the others still prefill.
    total = warmup + steps + 8 + batch
    config = EngineConfig(mode="off", slots=batch * (context + total) + 64,
                          max_running=batch)
    scheduler = Scheduler(make_engine(model, config), batch_tokens=8 * context + batch,
                          chunk_tokens=context)
    rng = np.random.default_rng(batch * 100_003 + context)
    for _ in range(batch):
        scheduler.add(rng.integers(0, vocab, context), SamplingParams(max_tokens=total))
    undo = _stub_forward(scheduler, vocab)
    try:
        while scheduler.waiting or any(r.state == "prefill" for r in scheduler.running):
            scheduler.step()
    finally:
        undo()
    with torch.no_grad():  # rows that differ per request, so their hidden states do too
        scheduler.engine.pool.ckv.normal_()
        scheduler.engine.pool.kr.normal_()
    for _ in range(warmup):
        _check(scheduler.step(), batch)
    touched = touched_experts(scheduler)
    # Steps back to back, the device drained only before the first and after the last: a
    # step's host work overlaps the device's forward of the next (Scheduler._launch_ahead), so
    # the time between consecutive steps' returns is the rhythm a serving loop runs at.
    sync(device)
    times, last = [], time.perf_counter()
    for _ in range(steps):
        outputs = scheduler.step()
        now = time.perf_counter()
        _check(outputs, batch)
        times.append(now - last)
        last = now
    sync(device)
    # Counted before any profile table: a second profiler session right after one saw almost
    # no kernels of the replayed graphs (an H200, torch 2.11).
    kernels = kernels_per_step(device, scheduler) if device.startswith("cuda") else None
    profile_table = None
    if profile:
        profile_table = _profile(device, scheduler)
    scheduler.check()
    scheduler.engine.close()  # under tensor parallel, the followers' pools are freed too
    always, expert, embedding = weight_bytes(model)
    moe_layers = sum(model.config.is_moe_layer(i) for i in range(model.config.num_hidden_layers))
    kv = batch * (context + warmup + steps) * kv_row_bytes(model)
    floor_bytes = always + moe_layers * touched * expert + batch * embedding + kv
    step = statistics.median(times)
    floor = floor_bytes / (copy_gbps * 1e9)
    out = {"batch": batch, "context": context, "step_ms": 1e3 * step,
           "tokens_per_s": batch / step, "floor_ms": 1e3 * floor, "step_over_floor": step / floor,
           "bytes": {"weights": always, "experts": int(moe_layers * touched * expert),
                     "kv": kv, "embedding": batch * embedding},
           "experts_touched_per_layer": touched, "steps": steps, "kernels_per_step": kernels}
    if profile_table is not None:
        out["profile"] = profile_table
    return out


def launch_us(device: str, kernels: int = 256, replays: int = 20) -> float:
    """Device µs per kernel of a CUDA graph of ``kernels`` launches of a kernel that stores one
    value: the least any kernel of a replayed step costs (median of ``replays``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _one(X):
        tl.store(X, 1.0)

    x = torch.zeros(1, device=device)
    return _graph_us(device, lambda _: _one[(1,)](x), kernels, replays)


def _graph_us(device: str, launch: Callable[[int], None], kernels: int, replays: int) -> float:
    """Device µs per launch of a CUDA graph of ``launch(0) .. launch(kernels − 1)``, median of
    ``replays`` replays (``launch(0)`` run once on a side stream first, as capture needs)."""
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        launch(0)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(kernels):
            launch(i)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / kernels)
    return statistics.median(times)


def chain_us(device: str, kernels: int = 256, programs: int = 132, replays: int = 20) -> float:
    """Device µs per kernel of a CUDA graph of ``kernels`` *dependent* launches, each launched
    as the engine launches its kernels (programmatic dependent launch where the device has it:
    it waits for the previous grid, then reads what that grid wrote) over ``programs`` programs
    that each read and write 4 KB: what a step's chain of dependent kernels costs per kernel
    at least, even with bytes too few to matter (median of ``replays``)."""
    import triton
    import triton.language as tl

    from irminsul.kernels.launch import pdl_args, wait_for_previous

    @triton.jit
    def _hop(SRC, DST, PDL: tl.constexpr):
        wait_for_previous(PDL)
        at = tl.program_id(0) * 2048 + tl.arange(0, 2048)
        tl.store(DST + at, tl.load(SRC + at) + 1.0)

    bufs = [torch.zeros(programs * 2048, dtype=torch.bfloat16, device=device) for _ in range(2)]
    pdl = pdl_args(bufs[0].device)
    return _graph_us(device, lambda i: _hop[(programs,)](bufs[i % 2], bufs[1 - i % 2], **pdl),
                     kernels, replays)


def kernels_per_step(device: str, scheduler: Scheduler, steps: int = 3) -> float:
    """Device kernels one step runs (mean over ``steps``; copies and memsets not counted)."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            scheduler.step()
        sync(device)
    kernels = [e for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    return len(kernels) / steps


def _profile(device: str, scheduler: Scheduler, steps: int = 5) -> str:
    """torch.profiler's table of the device kernels over a few steps, by total device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            scheduler.step()
        sync(device)
    key = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=60)
    if device.startswith("cuda"):
        table += "\n" + critical_path(prof, steps)
    return table


def critical_path(prof: Any, steps: int) -> str:
    """Each kernel's share of the step's wall time on the device, by name.

    A kernel launched with programmatic dependent launch is resident (and its profiled duration
    runs) while the one before it still works, so durations overlap and overstate. The time
    from the previous kernel's end to this one's end does not: summed over a step it is the
    step's device time, and it is what removing or speeding up this kernel could save."""
    kernels = sorted((e for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.name.startswith(("Memcpy", "Memset"))),
                     key=lambda e: e.time_range.end)
    exposed: dict[str, list[float]] = {}
    for before, kernel in itertools.pairwise(kernels):
        idle = max(0.0, kernel.time_range.start - before.time_range.end)
        row = exposed.setdefault(kernel.name[:60], [0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += kernel.time_range.end - before.time_range.end
        row[2] += kernel.time_range.elapsed_us()
        row[3] += idle
    lines = [f"{'kernel':<60} {'calls/step':>10} {'exposed µs/step':>16} "
             f"{'exposed µs/call':>16} {'duration µs/call':>17} {'idle before µs/step':>20}"]
    total = 0.0
    for name, (calls, ends, duration, idle) in sorted(exposed.items(),
                                                      key=lambda kv: -kv[1][1]):
        total += ends / steps
        lines.append(f"{name:<60} {calls / steps:>10.1f} {ends / steps:>16.1f} "
                     f"{ends / calls:>16.2f} {duration / calls:>17.2f} {idle / steps:>20.1f}")
    lines.append(f"{'all (end of first kernel to end of last, per step)':<60} "
                 f"{'':>10} {total:>16.1f}")
    # A stretch of the timeline from the middle of the run (about two layers): when each
    # kernel became resident and ended, relative to the first one's end.
    middle = kernels[len(kernels) // 2: len(kernels) // 2 + 26]
    origin = middle[0].time_range.end
    lines.append(f"\n{'timeline (µs)':<60} {'resident':>10} {'end':>10} {'exposed':>10}")
    for before, kernel in itertools.pairwise(middle):
        lines.append(f"{kernel.name[:60]:<60} {kernel.time_range.start - origin:>10.1f} "
                     f"{kernel.time_range.end - origin:>10.1f} "
                     f"{kernel.time_range.end - before.time_range.end:>10.1f}")
    return "\n".join(lines)


def _presets() -> dict[str, dict[str, Any]]:
    """The named arms: the engine as it ships, and the shared experts' order in the router's
    sort."""
    return {"engine": {}, "shared-last": {"router.SHARED_FIRST": False}}


def _switch(name: str) -> tuple[ModuleType, str]:
    """(module, attribute) of switch ``MODULE.NAME`` of irminsul.kernels."""
    module, _, attr = name.rpartition(".")
    try:
        owner = importlib.import_module(f"irminsul.kernels.{module}") if module else None
    except ImportError:
        owner = None
    if owner is None or not attr.isupper() or not hasattr(owner, attr):
        raise SystemExit(f"--arms: {name!r} is not a switch MODULE.NAME of irminsul.kernels "
                         "(an upper-case module constant)")
    return owner, attr


def parse_arm(text: str) -> tuple[str, dict[str, Any]]:
    """(label, settings) of one ``--arms`` entry: a preset, or MODULE.NAME=VALUE[,...] with
    each VALUE a Python literal of the switch's type (a bare word: a string)."""
    presets = _presets()
    if text in presets:
        return text, presets[text]
    settings: dict[str, Any] = {}
    for item in text.split(","):
        name, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--arms: {text!r} is neither a preset ({', '.join(presets)}) nor "
                             "MODULE.NAME=VALUE[,...]")
        default = getattr(*_switch(name))
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        if default is not None and value is not None and type(value) is not type(default):
            raise SystemExit(f"--arms: {name} is {type(default).__name__} "
                             f"({default!r}); {raw!r} is not")
        settings[name] = value
    return text, settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny float32 model (CPU smoke)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps per cell first")
    parser.add_argument("--profile", type=int, nargs=2, action="append", default=[],
                        metavar=("BATCH", "CONTEXT"),
                        help="also profile this cell's steps (torch.profiler table; repeatable)")
    parser.add_argument("--arms", nargs="+", default=["engine"], metavar="ARM",
                        help="each cell runs once per arm, in order (an A/B): a preset ("
                        + ", ".join(_presets()) + ") or MODULE.NAME=VALUE[,...] setting switches "
                        "of irminsul.kernels modules (e.g. launch.MODE=0); every "
                        "switch any arm sets is back at its default before the next arm")
    parser.add_argument("--out", required=True, help="results JSON")
    args = parser.parse_args()
    arms = [parse_arm(text) for text in args.arms]
    defaults = {name: getattr(*_switch(name)) for _, settings in arms for name in settings}
    model = build_model(args.device, tiny=args.tiny)
    copy_gbps = roofline.copy_bandwidth(args.device)
    results: dict[str, Any] = {"meta": run_metadata(args.device), "copy_gbps": copy_gbps,
                               "arms": {label: settings for label, settings in arms},
                               "cells": []}
    if args.device.startswith("cuda"):
        results["launch_us"] = launch_us(args.device)
        print(f"one-value kernel replayed from a graph: {results['launch_us']:.2f} µs", flush=True)
        results["chain_us"] = chain_us(args.device)
        print(f"dependent kernel replayed from a graph: {results['chain_us']:.2f} µs", flush=True)
    for context, batch, (arm, settings) in itertools.product(args.contexts, args.batches, arms):
        for name, value in {**defaults, **settings}.items():
            setattr(*_switch(name), value)
        profile = (f"{batch}x{context}" if [batch, context] in args.profile else None)
        cell = decode_cell(model, batch, context, args.steps, args.warmup, copy_gbps, profile)
        cell["arm"] = arm
        results["cells"].append(cell)
        print(f"{arm:>14}  "
              f"context {context:>6}  batch {batch:>4}: step {cell['step_ms']:8.2f} ms  "
              f"{cell['tokens_per_s']:9.0f} tok/s  floor {cell['floor_ms']:7.2f} ms  "
              f"step/floor {cell['step_over_floor']:5.2f}  experts/layer "
              f"{cell['experts_touched_per_layer']:.1f}  kernels/step "
              f"{cell['kernels_per_step'] or 0:.0f}", flush=True)
        if "profile" in cell:
            print(cell["profile"], flush=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
        torch.cuda.empty_cache() if args.device.startswith("cuda") else None


if __name__ == "__main__":
    main()
