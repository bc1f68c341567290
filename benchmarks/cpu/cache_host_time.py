"""The cache's own host time per live prefill, per TTFT cell, the device work stubbed out.

What live PIC adds on the host to a prefill of the GPU suite's TTFT cells
(benchmarks/gpu/shift_prompts.py):
before its forward can be issued — planning (radix match, chunking, fingerprints, registry
lookups) and serving the reused runs (slot allocation, eviction, reference counts) — and after it
(registering the new chunks, inserting the prompt in the radix tree, finishing the sequence; on a
GPU the registration overlaps the forward). The engine is the real one, over the tiny stand-in
model; its forward and its k_r rotation are stubbed, so what is timed is the bookkeeping alone,
on whatever CPU runs this (on the GPU machine, the one TTFT pays). Phases as
benchmarks/gpu/prefill_profile.py times them; medians over the requests after the warm-ups, in ms.

    python benchmarks/cpu/cache_host_time.py [--lengths 4096 16384 32768] [--headers 50 2000]
                                             [--requests 20] [--out F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

# The cells, the model and the phase timing are the GPU suite's own: import them as its scripts do.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from common import V2_LITE, AgentText, build_model, run_metadata  # noqa: E402
from prefill_profile import phases  # noqa: E402
from shift_prompts import build_requests  # noqa: E402
from ttft import cache_slots  # noqa: E402

from irminsul.config import EngineConfig  # noqa: E402
from irminsul.engine import Engine, ModelRunner  # noqa: E402
from irminsul.engine.batch import ForwardBatch, Reuse  # noqa: E402

PHASES = ("plan", "advance (reuse, alloc)", "commit")


class HostOnly(ModelRunner):
    """A model runner with no device work: forwards return zero logits, reuses rotate nothing."""

    def forward(self, batch: ForwardBatch, *, all_logits: bool = False) -> list[torch.Tensor]:
        return [torch.zeros(n if all_logits else 1, 1) for n in batch.lengths]

    def rotate(self, reuse: Reuse) -> None:
        pass


def cell(engine: Engine, requests: list, warmup: int) -> dict[str, float]:
    """Median ms of each of :func:`prefill_profile.phases`' host phases over ``requests`` after
    the first ``warmup`` (the stubbed forward's own phases left out)."""
    times = [phases(engine, request) for request in requests][warmup:]
    return {phase: statistics.median(t[phase] for t in times) for phase in PHASES}


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform reports."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--headers", type=int, nargs="+", default=[50, 2000],
                        help="agent_meta's persona lengths")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", help="also write the figures as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model("cpu", tiny=True)
    text = AgentText(V2_LITE["vocab_size"])  # chunk boundaries as over V2-Lite's token ids
    rows = []
    print(f"{'pattern':>10} {'prompt':>6} {'H':>5} " + " ".join(f"{p:>22}" for p in PHASES))
    for length in args.lengths:
        specs = [("agent_meta", h) for h in args.headers] + [("sysvar", 50), ("rerank", 0)]
        for pattern, header in specs:
            requests = build_requests(pattern, text, length, args.requests + args.warmup,
                                      header=header, seed=length)
            config = EngineConfig(slots=cache_slots(length, len(requests)), mode="live",
                                  kernels=False, graphs=False)
            engine = Engine(model, config, runner=HostOnly)
            row = {"pattern": pattern, "prompt_tokens": length, "header_tokens": header,
                   **cell(engine, requests, args.warmup)}
            rows.append(row)
            print(f"{pattern:>10} {length:>6} {header:>5} "
                  + " ".join(f"{row[p]:>22.3f}" for p in PHASES), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({**run_metadata("cpu"), "cpu": cpu_name(), "numpy": np.__version__,
                       "phases_ms_p50": rows}, f, indent=1)


if __name__ == "__main__":
    main()
