"""Where a live-PIC prefill's time goes: host phases, operators, and host–device syncs.

For one TTFT cell (pattern, prompt length), after the cell's warm-up requests:

    phases   host milliseconds of planning (start_prefill), serving cached runs and allocating
             (advance), issuing the forward (run_batch, returns before the device is done),
             waiting for the device, and committing (complete_prefill), medians over
             ``--samples`` requests; the ideal forward's (novel spans only) as the floor
    syncs    every call inside one request's forward that made the host wait for the device
             (torch's sync debug mode): each one stops the host from queueing ahead
    ops      the top operators of one request by host time and by device time (torch.profiler),
             and the device time of the ideal forward of the same request

    python benchmarks/gpu/prefill_profile.py [--pattern agent_meta] [--length 16384] [--samples 5]
                                         [--out F.txt]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
import warnings
from collections import Counter
from contextlib import redirect_stdout

import torch
from common import AgentText, build_model, run_metadata, sync, timed
from shift_prompts import PATTERNS, ShiftRequest, build_requests
from ttft import cache_slots, ideal

from irminsul.config import EngineConfig
from irminsul.engine import Engine


def phases(engine: Engine, request: ShiftRequest) -> dict[str, float]:
    """Host milliseconds of each step of one prefill."""
    device = engine.pool.ckv.device
    times: Counter[str] = Counter()
    sync(device)
    start = time.perf_counter()
    prefill = engine.start_prefill(request.prompt, request.resets)
    times["plan"] += time.perf_counter() - start
    while True:
        start = time.perf_counter()
        span = engine.advance(prefill, prefill.prompt.size)
        times["advance (reuse, alloc)"] += time.perf_counter() - start
        if span is None:
            break
        start = time.perf_counter()
        engine.run_batch([(prefill.seq, *span)])
        times["forward issued"] += time.perf_counter() - start
        start = time.perf_counter()
        sync(device)
        times["device drained"] += time.perf_counter() - start
    start = time.perf_counter()
    engine.complete_prefill(prefill)
    engine.finish(prefill.seq)
    times["commit"] += time.perf_counter() - start
    return {name: 1e3 * seconds for name, seconds in times.items()}


def forward_syncs(engine: Engine, request: ShiftRequest) -> Counter[str]:
    """Source lines that synchronised with the device inside one prefill's forwards."""
    found: Counter[str] = Counter()
    run_batch = engine.run_batch

    def watched(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return run_batch(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                found.update(f"{w.filename}:{w.lineno}" for w in caught)

    engine.run_batch = watched
    try:
        seq, _ = engine.prefill(request.prompt, request.resets)
        engine.finish(seq)
    finally:
        del engine.run_batch  # the class's method again
    return found


def _busy(table: torch.autograd.profiler_util.EventList) -> float:
    """Milliseconds the device spent in the profiled operators."""
    return sum(e.self_device_time_total for e in table) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pattern", choices=PATTERNS, default="agent_meta")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--header", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--samples", type=int, default=5,
                        help="requests whose phases are timed (medians printed)")
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    model = build_model("cuda")
    text = AgentText(model.config.vocab_size)
    requests = build_requests(args.pattern, text, args.length, args.warmup + args.samples + 2,
                              header=args.header, seed=args.length)
    live = Engine(model, EngineConfig(slots=cache_slots(args.length, len(requests)), mode="live"))
    floor = Engine(model, EngineConfig(slots=4 * args.length + 64, mode="off"))
    reference, _ = floor.prefill(requests[0].prompt, namespace=-1)
    for request in requests[:args.warmup]:
        phases(live, request)
        ideal(floor, reference, request)
    report = io.StringIO()
    with redirect_stdout(report):
        meta = run_metadata("cuda")  # the report reads the run's date and software from this line
        print(f"{args.pattern} L={args.length} H={args.header}, {meta['device']}, "
              f"torch {meta['torch']}, {meta['date']}")
        sampled = requests[args.warmup:args.warmup + args.samples]
        samples = [phases(live, request) for request in sampled]
        timing = {name: statistics.median(t[name] for t in samples) for name in samples[0]}
        print(f"PIC live phases (ms, median of {len(samples)}): "
              + ", ".join(f"{k} {v:.1f}" for k, v in timing.items())
              + f"; total {sum(timing.values()):.1f}")
        floors = [timed("cuda", ideal, floor, reference, request)[0] for request in sampled]
        print(f"ideal forward (ms, median): {1e3 * statistics.median(floors):.1f}")
        syncs = forward_syncs(live, requests[-2])
        print(f"syncs inside the forward: {sum(syncs.values())}"
              + "".join(f"\n  {n:4d}  {where}" for where, n in syncs.most_common()))
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            phases(live, requests[-1])
        table = prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=25))
        print(table.table(sort_by="self_device_time_total", row_limit=15))
        print(f"device busy {_busy(table):.1f} ms of the profiled prefill")
        with torch.profiler.profile(activities=activities) as prof:
            ideal(floor, reference, requests[-1])
        print(f"ideal: device busy {_busy(prof.key_averages()):.1f} ms")
    print(report.getvalue())
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report.getvalue())
    floor.finish(reference, remember=False)


if __name__ == "__main__":
    main()
