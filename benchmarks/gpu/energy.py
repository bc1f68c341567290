"""NVML energy per prefill for a miss, an exact-prefix hit and a PIC hit (a GPU suite section).

The paper's Table 1 protocol: the GPU's total-energy counter (mJ) is read at event boundaries,
3 warm-up and 10 timed readings per cell. NVML integrates power over a ~10 ms window, so an event
shorter than that can read exactly 0 J: an instrument artefact, not a measurement. As the paper
does, zero readings are dropped, a cell aggregates the non-zero ones (mean, and median/p95 here)
and is reported only with at least 5 of them. The paper's proposed instrument fix is applied as
well: each reading spans ``batch`` back-to-back prefills and is divided by ``batch``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
from common import sync
from shift_prompts import ShiftRequest
from ttft import no_cache

from irminsul.config import EngineConfig
from irminsul.engine import Engine
from irminsul.model import MLAModel

MIN_NONZERO = 5  # the paper's floor for reporting a cell
Counter = Callable[[], float]  # the energy counter in mJ


def nvml_counter(index: int = 0) -> Counter:
    """The GPU's total energy counter (mJ since driver load), read through pynvml."""
    import pynvml  # only on the GPU machine

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    return lambda: float(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))


def aggregate(joules: list[float]) -> dict[str, Any]:
    """The paper's zero-sample handling: statistics over the non-zero readings only."""
    nonzero = [j for j in joules if j > 0]
    out: dict[str, Any] = {"readings": len(joules), "zero_readings": len(joules) - len(nonzero),
                           "reported": len(nonzero) >= MIN_NONZERO}
    if nonzero:
        out.update(mean_j=statistics.fmean(nonzero), p50_j=statistics.median(nonzero),
                   p95_j=float(np.percentile(nonzero, 95)))
    return out


def measure(prefill: Callable[[], Any], counter: Counter, device: str, *, batch: int,
            warmup: int = 3, repeats: int = 10) -> dict[str, Any]:
    """J per prefill: ``warmup`` + ``repeats`` readings of ``batch`` prefills each."""
    joules = []
    for i in range(warmup + repeats):
        sync(device)
        before = counter()
        for _ in range(batch):
            prefill()
        sync(device)
        if i >= warmup:
            joules.append((counter() - before) / 1e3 / batch)
    return aggregate(joules)


def prefill_energy(model: MLAModel, requests: list[ShiftRequest], counter: Counter, *,
                   batch: int, warmup: int = 3, repeats: int = 10) -> dict[str, Any]:
    """Energy per prefill of one prompt length's agent_meta requests:

    miss         a full prefill through the engine, nothing cached (a namespace of its own);
    prefix hit   the same prompt again, the radix tree serving all but its last token;
    PIC hit      a new header before the shared body, live PIC serving the shifted body.

    Every request should be distinct and there should be one per prefill (readings × batch), so
    that no PIC-hit prompt is ever served whole from the radix tree.
    """
    device = str(model.lm_head.weight.device)
    length = requests[0].prompt.size
    engines = {name: Engine(model, EngineConfig(slots=4 * length + 64,
                                                mode="live" if name == "live" else "off"))
               for name in ("none", "off", "live")}
    namespaces = iter(range(1, 10**9))  # every miss in a namespace of its own
    walk = iter(range(10**9))  # walks the requests: every PIC-hit prefill has a fresh header

    def serve(mode: str, request: ShiftRequest) -> None:
        seq, _ = engines[mode].prefill(request.prompt, request.resets)
        engines[mode].finish(seq)

    events = {"miss": lambda: no_cache(engines["none"], requests[0], next(namespaces)),
              "prefix hit": lambda: serve("off", requests[0]),
              "PIC hit": lambda: serve("live", requests[next(walk) % len(requests)])}
    serve("off", requests[0])  # the prefix hit's prompt is cached before its warm-ups
    out: dict[str, Any] = {"prompt_tokens": length, "batch": batch}
    out.update({name: measure(fn, counter, device, batch=batch, warmup=warmup, repeats=repeats)
                for name, fn in events.items()})
    miss = out["miss"].get("mean_j")
    for name in ("prefix hit", "PIC hit"):
        if miss and out[name].get("mean_j"):
            out[name]["over_miss"] = out[name]["mean_j"] / miss
            out[name]["saving"] = 1 - out[name]["over_miss"]
    return out
