"""What the CUDA graphs cost at engine start: capture time and device memory beside the pool.

Builds a live engine over random DeepSeek-V2-Lite weights (bf16) and reports the seconds its
construction took (capturing every bucket's graph, compiling the kernels they launch) and the
device memory allocated beyond the model and the KV pool (graph pools, static inputs, staging).

    python benchmarks/gpu/graph_capture.py [--slots 200000]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import build_model

from irminsul.config import EngineConfig
from irminsul.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=200_000, help="KV pool slots")
    args = parser.parse_args()
    model = build_model("cuda")
    torch.cuda.synchronize()
    base, start = torch.cuda.memory_allocated(), time.perf_counter()
    engine = Engine(model, EngineConfig(mode="live", slots=args.slots))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    pool = sum(t.numel() * t.element_size() for t in (engine.pool.ckv, engine.pool.kr))
    beside = (torch.cuda.memory_allocated() - base - pool) / 2**20
    graphs = len(engine.runner.graphs.forwards) if engine.runner.graphs else 0
    print(f"engine start {elapsed:.2f} s; graphs {graphs}; memory beyond the pool {beside:.0f} MiB")


if __name__ == "__main__":
    main()
