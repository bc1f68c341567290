"""The gate's result as text: per-probe figures, the means, and the verdict with its reason."""

from __future__ import annotations

import math

from ..analysis.report import table
from .gate import GateResult


def _figure(value: float, fmt: str) -> str:
    return "—" if math.isnan(value) else format(value, fmt)


def render_gate(result: GateResult) -> str:
    """A table of every probe (KL of PIC and of naive reuse, argmax match, first divergence,
    tokens PIC served from the registry and as a derived prefix), the means the verdict is taken
    on, and PASS or REFUSED with why."""
    rows = [[p.name, p.kind, f"{p.pic_tokens} + {p.derived_tokens}/{p.prompt_tokens}",
             f"{p.kl_pic:.3g}",
             f"{p.kl_naive:.3g}", f"{p.argmax_pic:.3f}", f"{p.argmax_naive:.3f}",
             f"{p.first_divergence_pic}", f"{p.first_divergence_naive}"]
            for p in result.probes]
    rows.append(["mean (probes served reused content)", "", "", _figure(result.kl_pic, ".3g"),
                 _figure(result.kl_naive, ".3g"), _figure(result.argmax, ".3f"),
                 _figure(result.argmax_naive, ".3f"), _figure(result.first_divergence, ".2f"),
                 _figure(result.first_divergence_naive, ".2f")])
    source = "cached result" if result.cached else "measured now"
    title = (f"PIC correctness gate: checkpoint {result.checkpoint[:16]}, {result.tokens} "
             f"continuation tokens per probe ({source}); KL in nats per token against full "
             "recomputation")
    text = table(title, ["probe", "kind", "PIC + derived tokens/prompt", "KL PIC", "KL naive",
                         "argmax PIC", "argmax naive", "1st div. PIC", "1st div. naive"], rows)
    verdict = "PASS" if result.passed else "REFUSED"
    return f"{text}\n{verdict}: {result.reason}"
