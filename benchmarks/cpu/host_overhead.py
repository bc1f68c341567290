"""Host overhead of the model's plain-torch forward: time and ops dispatched per 1-token forward.

DeepSeek-V2-Lite's 27-layer structure at tiny widths, one new token against a short context, so
the arithmetic is negligible and what is timed is the per-layer work of issuing ops (on a GPU:
kernel launches). Prints the median time per forward and the number of
torch ops dispatched per forward.

    python benchmarks/cpu/host_overhead.py [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The model builders and the timer are the GPU suite's: import them as its scripts do.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from common import TINY, random_model, timed  # noqa: E402


class _Count(TorchDispatchMode):
    """Counts the aten ops a region dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    raw = dict(TINY, num_hidden_layers=27)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = random_model(raw, args.device, dtype)
    ids, positions = torch.tensor([5]), torch.tensor([100])
    width = raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
    context = [torch.randn(100, width, dtype=dtype, device=args.device) for _ in range(27)]
    for _ in range(5):
        model.forward(ids, positions, context)
    seconds = [timed(args.device, model.forward, ids, positions, context)[0]
               for _ in range(args.repeats)]
    with _Count() as count:
        model.forward(ids, positions, context)
    print(f"{1e3 * statistics.median(seconds):.2f} ms per 1-token forward (27 layers, "
          f"{args.device}), {count.ops} ops dispatched ({count.ops / 27:.0f} per layer)")


if __name__ == "__main__":
    main()
