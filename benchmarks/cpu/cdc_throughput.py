"""Chunking + fingerprinting throughput on one core (target: >= 100 M tokens/s).

Prints tokens/s for chunk_boundaries, fingerprints and both together, on real agent text (the
shipped sample logs rendered with the DeepSeek tokenizer, tiled to the requested size) and on
uniform random ids, each as a median over repeats, with the ratio to one numpy pass (a sum) over
the same array as a machine-independent yardstick.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core, as the target says

import numpy as np  # noqa: E402

from irminsul.cache.cdc import chunk_boundaries, fingerprints  # noqa: E402
from irminsul.traffic.logs import sample_logs  # noqa: E402
from irminsul.traffic.prompt import message_tokens  # noqa: E402
from irminsul.traffic.render import ChatRenderer  # noqa: E402


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _real_tokens(size: int) -> np.ndarray:
    text = message_tokens(ChatRenderer.default(), sample_logs())
    return np.resize(text, size).astype(np.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    inputs = {
        "real agent text": _real_tokens(args.tokens),
        "random ids": np.random.default_rng(0).integers(0, 129_280, args.tokens).astype(np.int32),
    }
    print(f"{'input':<16} {'chunks':>9} {'mean size':>9} {'chunk Mtok/s':>13} "
          f"{'fp Mtok/s':>10} {'both Mtok/s':>12} {'both / numpy sum':>17}")
    for name, tokens in inputs.items():
        bounds = chunk_boundaries(tokens)
        t_chunk = _median_seconds(partial(chunk_boundaries, tokens), args.repeats)
        t_fp = _median_seconds(partial(fingerprints, tokens, bounds), args.repeats)
        t_sum = _median_seconds(tokens.sum, args.repeats)
        n = tokens.size
        both = t_chunk + t_fp
        print(f"{name:<16} {bounds.size:>9,} {n / bounds.size:>9.1f} {n / t_chunk / 1e6:>13.0f} "
              f"{n / t_fp / 1e6:>10.0f} {n / both / 1e6:>12.0f} {both / t_sum:>16.1f}x")


if __name__ == "__main__":
    main()
