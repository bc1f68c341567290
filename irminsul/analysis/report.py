"""Readable tables of ``analyze`` reports (the JSON is the source of truth; these only format it)."""

from __future__ import annotations

from collections.abc import Sequence

from .recoverability import MASK_SWEEP
from .replay import STRATEGIES


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A fixed-width text table; the first column left-aligned, the rest right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    rule = "-" * len(line(header))
    return "\n".join([title, rule, line(header), rule, *map(line, rows), rule])


def _name(report: dict) -> str:
    return report.get("name") or report["log"].rsplit("/", 1)[-1]


def render_reports(reports: Sequence[dict]) -> str:
    """The three tables (characterisation, recoverability, replay) over several logs."""
    char_rows, rec_rows, sweep_rows, replay_rows = [], [], [], []
    for rep in reports:
        c, r, p = rep["characterisation"], rep["recoverability"], rep["replay"]
        char_rows.append([_name(rep), f"{rep['requests']:,}", f"{rep['prompt_tokens']:,}",
                          _pct(c["exact_prefix"]), _pct(c["shifted_within"]),
                          _pct(c["shifted_cross"]), _pct(c["novel"]),
                          f"{_pct(c['per_session']['shifted']['p50'])} / "
                          f"{_pct(c['per_session']['shifted']['p95'])}"])
        rec_rows.append([_name(rep), f"{r['non_prefix_tokens']:,}", _pct(r["fixed_block"]),
                         _pct(r["cdc"]), _pct(r["cdc_fallback"])])
        sweep_rows.append([_name(rep), *(_pct(r["mask_sweep"][str(k)]) for k in MASK_SWEEP)])
        replay_rows.append([_name(rep), _pct(p["default"]["exact_prefix"]),
                            *(_pct(p[s]["pic_unique"]) for s in STRATEGIES),
                            _pct(p["default"]["total"])])
    default = reports[0]["replay"]["default"]["strategy"] if reports else ""
    capacity = reports[0]["replay"]["capacity"] if reports else None
    return "\n\n".join([
        table("Characterisation (paper §3): share of prompt tokens",
              ["log", "requests", "prompt tokens", "exact-prefix", "shifted/within",
               "shifted/cross", "novel", "shifted/session p50 / p95"], char_rows),
        table("Recoverability (paper §4): share of non-prefix tokens found again",
              ["log", "non-prefix tokens", "fixed-block", "CDC", "CDC+fallback"], rec_rows),
        table("Mask-bits sweep (Appendix B): CDC recovery by k",
              ["log", *(f"k={k}" for k in MASK_SWEEP)], sweep_rows),
        table(f"Serve-path replay (capacity {capacity or 'unbounded'} tokens; engine: the engine's "
              f"planner, the rest: Algorithm 1): share of prompt tokens; PIC-unique per "
              f"strategy, total for {default}",
              ["log", "exact-prefix", *(f"PIC {s}" for s in STRATEGIES), "total"], replay_rows),
    ])
