"""What an L2 prefetch buys a cold weight read: decode-sized GEMVs (V2-Lite's o_proj and shared
MLP) timed cold (after a 512 MB write evicts L2), right after ``prefetch_l2`` of their weight, and
repeated (already in L2); then the prefetch kernel's own time for 8-64 MB at 16-132 programs.
Device time per kernel from torch.profiler, mean of 30 repeats.

    python benchmarks/gpu/l2_prefetch.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from irminsul.kernels.prefetch import prefetch_l2


def kernels(fn: Callable[[], object], reps: int = 30) -> dict[str, tuple[float, int]]:
    """Mean device µs and count per kernel name over ``reps`` calls of ``fn`` (after 3)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key[:50]: (round(e.device_time_total / e.count, 2), e.count)
            for e in prof.key_averages() if e.device_time_total > 0}


def main() -> None:
    dev = "cuda"
    scrub = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    x = torch.randn(1, 2048, dtype=torch.bfloat16, device=dev)
    o_proj = torch.randn(2048, 2048, dtype=torch.bfloat16, device=dev)
    gate = torch.randn(2816, 2048, dtype=torch.bfloat16, device=dev)  # gate or up: one shape
    down = torch.randn(2048, 2816, dtype=torch.bfloat16, device=dev)
    h = torch.randn(1, 2816, dtype=torch.bfloat16, device=dev)

    def shared() -> None:
        F.linear(x, gate), F.linear(x, gate), F.linear(h, down)

    cases = {
        "o_proj cold": lambda: (scrub.zero_(), F.linear(x, o_proj)),
        "o_proj prefetched": lambda: (scrub.zero_(), prefetch_l2([o_proj]), F.linear(x, o_proj)),
        "o_proj repeated": lambda: (F.linear(x, o_proj), F.linear(x, o_proj)),
        "shared MLP cold": lambda: (scrub.zero_(), shared()),
        "shared MLP prefetched": lambda: (scrub.zero_(), prefetch_l2([o_proj, gate, gate, down]),
                                          shared()),
    }
    for name, fn in cases.items():
        print(name, kernels(fn), flush=True)
    for mb in (8, 32, 64):
        t = torch.empty(mb << 20, dtype=torch.uint8, device=dev)
        for programs in (16, 32, 64, 132):
            got = kernels(lambda t=t, p=programs: (scrub.zero_(), prefetch_l2([t], p)))
            print(f"prefetch {mb} MB, {programs} programs", got, flush=True)


if __name__ == "__main__":
    main()
