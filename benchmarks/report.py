"""Render an ``issue5.py`` results JSON as the README's markdown tables (every figure, met or not).

    python benchmarks/results_table.py docs/results/DATE-h200-issue5.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from typing import Any

MODES = ("no cache", "exact prefix", "PIC live", "ideal")


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens >= 1024 else str(tokens)


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def targets(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(target, measured figure, met?) for each of issue #5's targets the JSON has figures for."""
    out = []
    cells = r.get("ttft", [])
    if cells:
        worst = max(cells, key=lambda c: c["live_over_ideal"])
        out.append(("PIC-live TTFT ≤ 1.15× ideal (every cell)",
                    f"worst {worst['live_over_ideal']:.2f}× ({worst['pattern']}, "
                    f"{_k(worst['prompt_tokens'])}, H {worst['header_tokens']})",
                    _met(worst["live_over_ideal"] <= 1.15)))
        for c in cells:
            if c["pattern"] == "agent_meta" and c["prompt_tokens"] == 16384:
                # An exact-prefix cache that matches almost nothing should cost no more than no
                # cache; where our off-mode path is slower (it attends to its few matched rows
                # through a masked kernel), the target is judged against the faster of the two.
                base = min(c["exact prefix"]["p50_ms"], c["no cache"]["p50_ms"])
                ratio = base / c["PIC live"]["p50_ms"]
                out.append((f"agent_meta 16K H {c['header_tokens']}: ≥ 3.5× faster than exact "
                            "prefix (or no cache, if faster)",
                            f"{ratio:.2f}× ({c['exact_prefix_over_live']:.2f}× vs our exact "
                            "prefix)", _met(ratio >= 3.5)))
    for length, d in r.get("decode", {}).items():
        out.append((f"decode tok/s within 3% of PIC off ({_k(int(length))})",
                    f"{d['live']:.1f} vs {d['off']:.1f} tok/s ({d['live_over_off']:.3f}×)",
                    _met(d["live_over_off"] >= 0.97)))
    roof = r.get("roofline")
    if roof:
        p = roof["prefill"]
        out.append((f"fresh {_k(p['tokens'])} prefill ≥ 35% of bf16 matmul peak (active FLOPs)",
                    f"{p['tflops']:.0f} of {roof['matmul_peak_tflops']:.0f} TFLOP/s "
                    f"({100 * p['fraction_of_matmul_peak']:.0f}%)",
                    _met(p["fraction_of_matmul_peak"] >= 0.35)))
        for name, rot in roof["rotation"].items():
            same = (f"; {100 * rot['fraction_of_same_bytes_copy']:.0f}% of a copy of the same "
                    f"bytes, {rot['same_bytes_copy_gbps']:.0f} GB/s"
                    if "same_bytes_copy_gbps" in rot else "")
            issue = (f" on the device, {rot['issue_us']:.0f} µs to launch"
                     if "issue_us" in rot else "")
            out.append((f"δ-rotation ≥ 70% of copy bandwidth ({name}, {_k(rot['tokens'])} tokens)",
                        f"{rot['gbps']:.0f} of {roof['copy_gbps']:.0f} GB/s "
                        f"({100 * rot['fraction_of_copy_bandwidth']:.0f}%, {rot['us']:.0f} µs"
                        f"{issue}{same})", _met(rot["fraction_of_copy_bandwidth"] >= 0.70)))
    return out


def render(r: dict[str, Any]) -> str:
    """The markdown: run line, targets, TTFT cells, energy, memory, transformers baseline."""
    lines = [f"{r['date'][:10]}, {r['device']}, torch {r['torch']}, {r['model']}, "
             f"{r['engine']}.", ""]
    lines += _table(("target", "measured", ""), targets(r)) + [""]
    cells = r.get("ttft", [])
    if cells:
        lines += [f"TTFT, ms, p50 / p95 over {cells[0]['requests']} requests after "
                  f"{cells[0]['warmup']} warm-ups; served = prompt tokens from cache "
                  "(exact prefix / PIC live):", ""]
        lines += _table(
            ("pattern", "prompt", "H", "served", *MODES, "live / ideal", "exact prefix / live"),
            [(c["pattern"], _k(c["prompt_tokens"]), c["header_tokens"] or "–",
              f"{100 * c['served']['exact prefix']:.1f}% / {100 * c['served']['PIC live']:.1f}%",
              *(f"{c[m]['p50_ms']:.0f} / {c[m]['p95_ms']:.0f}" for m in MODES),
              f"{c['live_over_ideal']:.2f}×", f"{c['exact_prefix_over_live']:.2f}×")
             for c in cells]) + [""]
    e = r.get("energy")
    if e:
        lines += [f"NVML energy per prefill at {_k(e['prompt_tokens'])}, J (non-zero readings of "
                  f"{e['batch']} prefills each):", ""]
        events = ("miss", "prefix hit", "PIC hit")
        lines += _table(("event", "mean", "p50", "p95", "zero readings", "vs miss"),
                        [(n, *(f"{e[n].get(k, float('nan')):.2f}" for k in ("mean_j", "p50_j", "p95_j")),
                          f"{e[n]['zero_readings']}/{e[n]['readings']}",
                          f"{e[n]['over_miss']:.2f}×" if "over_miss" in e[n] else "–")
                         for n in events]) + [""]
    if r.get("memory"):
        lines += ["KV MB per session, N sessions sharing a shifted body:", ""]
        lines += _table(("N", "exact prefix", "PIC live", "live / off"),
                        [(m["sessions"], f"{m['off_mb_per_session']:.1f}",
                          f"{m['live_mb_per_session']:.1f}", f"{m['live_over_off']:.2f}×")
                         for m in r["memory"]]) + [""]
    if r.get("transformers"):
        lines += ["transformers `generate` (1 new token), same shapes and text, TTFT ms p50 / p95:",
                  ""]
        lines += _table(("prompt", "TTFT"), [(_k(int(n)), f"{t['p50_ms']:.0f} / {t['p95_ms']:.0f}")
                                             for n, t in r["transformers"].items()])
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a JSON written by benchmarks/issue5.py")
    args = parser.parse_args()
    with open(args.results, encoding="utf-8") as f:
        print(render(json.load(f)), end="")


if __name__ == "__main__":
    main()
