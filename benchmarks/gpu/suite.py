"""The GPU suite: every serving figure of one GPU in one run, written as one JSON.

Sections: TTFT cells (agent_meta at each H, sysvar, rerank; per prompt length), NVML energy per
prefill (miss / prefix hit / PIC hit), measured peaks and the prefill's and rotation's share of
them, decode tokens/s PIC live vs off, KV bytes per session at N concurrent sessions, and the
transformers ``generate`` baseline. The JSON is rewritten after every section, so a run cut short
keeps what it finished. ``benchmarks/report.py`` renders it into docs/performance.md.

    python benchmarks/gpu/suite.py --out docs/results/gpu-suite.json [--quick]
    python benchmarks/gpu/suite.py --device cpu --tiny --out /tmp/smoke.json   # CI-sized
    python benchmarks/gpu/suite.py --sections ttft --patterns rerank --out F.json  # some cells
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import energy
import roofline
import session_memory
import torch
import ttft
from common import AgentText, build_model, model_config, run_metadata
from shift_prompts import PATTERNS, build_requests

from irminsul.engine.model_runner import default_graphs, default_kernels

SECTIONS = ("ttft", "energy", "roofline", "decode", "memory", "transformers")


def sizes(args: argparse.Namespace) -> dict[str, Any]:
    """Problem sizes: the full run's, fewer for ``--quick``, CI-sized for ``--tiny``."""
    if args.tiny:
        return dict(lengths=[256], headers=[50], requests=3, warmup=1, energy_length=256,
                    energy_batch=1, decode=[256], decode_batch=2, decode_tokens=4,
                    sessions=[1, 2], session_body=512, matmul=256, copy_bytes=2**20,
                    prefill=256, rotate_tokens=200)
    return dict(lengths=[4096, 16384] if args.quick else [4096, 16384, 32768],
                headers=[50, 2000], requests=args.requests, warmup=2, energy_length=4096,
                energy_batch=3 if args.quick else 5,
                decode=[4096] if args.quick else [4096, 16384], decode_batch=8, decode_tokens=32,
                sessions=[1, 8, 32], session_body=4096, matmul=8192, copy_bytes=2**30,
                prefill=16384, rotate_tokens=15360)


def describe(model: torch.nn.Module) -> str:
    """What an engine runs by default on this device, for the results' header."""
    kernels = default_kernels(model)
    if not kernels:
        return "irminsul, plain torch"
    graphs = ", CUDA graphs for batches of short spans" if default_graphs(model, kernels) else ""
    return f"irminsul, Triton attention + rotation kernels{graphs}"


def ttft_cells(model: torch.nn.Module, text: AgentText, s: dict[str, Any], sysvar_depth: int,
               save: Callable[[list[dict[str, Any]]], None],
               patterns: Sequence[str] = PATTERNS) -> list[dict[str, Any]]:
    """Every (length, pattern, H) cell of ``patterns``, printed and saved as it finishes."""
    # A discarded cell first: Triton compiles each kernel variant on first use, which would
    # otherwise land inside the first cell's timed requests.
    ttft.ttft_cell(model, build_requests("rerank", text, s["lengths"][0], 4, seed=1), 2)
    cells = []
    for length in s["lengths"]:
        specs = [("agent_meta", h) for h in s["headers"]] + [("sysvar", sysvar_depth),
                                                              ("rerank", 0)]
        for pattern, header in specs:
            if pattern not in patterns:
                continue
            requests = build_requests(pattern, text, length, s["requests"] + s["warmup"],
                                      header=header, seed=length)
            cell = {"pattern": pattern, "header_tokens": header,
                    **ttft.ttft_cell(model, requests, s["warmup"])}
            cells.append(cell)
            print(f"{pattern:>10} L={length:>6} H={header:>5} served "
                  f"{100 * cell['served']['PIC live']:5.1f}% "
                  + "  ".join(f"{m} {cell[m]['p50_ms']:7.1f}" for m in ttft.MODES)
                  + f"  live/ideal {cell['live_over_ideal']:.2f}x", flush=True)
            save(cells)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--model", help="a real checkpoint directory (default: random V2-Lite)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (CPU smoke)")
    parser.add_argument("--quick", action="store_true", help="4K and 16K only, fewer repeats")
    parser.add_argument("--requests", type=int, default=20, help="timed requests per TTFT cell")
    parser.add_argument("--sysvar-depth", type=int, default=50)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--patterns", nargs="+", choices=PATTERNS, default=list(PATTERNS),
                        help="the TTFT cells' patterns (default: all)")
    parser.add_argument("--extend", help="a results JSON of an earlier run to add these sections "
                        "to (the run split over two commands)")
    args = parser.parse_args()
    s = sizes(args)
    started = time.perf_counter()
    meta = run_metadata(args.device)
    earlier: dict[str, Any] = {}
    if args.extend:
        with open(args.extend, encoding="utf-8") as f:
            earlier = json.load(f)
        # One file names one device: sections of another GPU would be labelled with this one's.
        if earlier.get("device") != meta.get("device"):
            raise SystemExit(f"--extend {args.extend}: its sections ran on "
                             f"{earlier.get('device')!r}, this run on {meta.get('device')!r}; "
                             "write this run to a file of its own")
    model = build_model(args.device, tiny=args.tiny, checkpoint=args.model)
    text = AgentText(model.config.vocab_size)
    results: dict[str, Any] = {
        **meta,
        "model": args.model or ("tiny random" if args.tiny else "random DeepSeek-V2-Lite shapes, bf16"),
        "engine": describe(model),
        "sizes": s}
    results.update({k: v for k, v in earlier.items() if k in SECTIONS})

    def save(section: str, value: Any) -> None:
        results[section] = value
        results["wall_s"] = time.perf_counter() - started
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
        print(f"[{results['wall_s']:6.1f} s] {section} done", flush=True)

    for section in args.sections:
        if section == "ttft":
            ttft_cells(model, text, s, args.sysvar_depth, partial(save, section), args.patterns)
        elif section == "energy" and torch.device(args.device).type == "cuda":
            count = (3 + 10) * s["energy_batch"] + 1  # one distinct request per prefill
            requests = build_requests("agent_meta", text, s["energy_length"], count, header=50)
            save(section, energy.prefill_energy(model, requests, energy.nvml_counter(),
                                                batch=s["energy_batch"]))
        elif section == "roofline":
            peak = roofline.matmul_peak(args.device, s["matmul"])
            copy = roofline.copy_bandwidth(args.device, s["copy_bytes"])
            ids = torch.from_numpy(text.tokens[:s["prefill"]])
            save(section, {
                "matmul_peak_tflops": peak, "copy_gbps": copy,
                "prefill": roofline.prefill_efficiency(model, ids, peak),
                "rotation": {name: roofline.rotation_bandwidth(model, fn, s["rotate_tokens"], copy)
                             for name, fn in roofline.rotate_implementations(args.device).items()}})
        elif section == "decode":
            save(section, {length: ttft.decode_rate(model, text, length, 250,
                                                        s["decode_batch"], s["decode_tokens"])
                           for length in s["decode"]})
        elif section == "memory":
            save(section, session_memory.session_bytes(s["sessions"], s["session_body"],
                                                       device=args.device))
        elif section == "transformers" and not args.model:
            save(section, ttft.transformers_ttft(model_config(args.tiny), args.device,
                                                     s["lengths"], text, max(s["requests"] // 2, 2)))


if __name__ == "__main__":
    main()
