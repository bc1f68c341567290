"""``irminsul analyze --html``: one self-contained page of charts and a plain-language summary.

Everything the page shows comes from the JSON reports (:func:`~irminsul.analysis.analyze.analyze_log`);
the charts are inline SVG (:mod:`.charts`), so the file opens anywhere, offline, on its own.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from .charts import CHARTS

ROLE_NAMES = {"system": "system prompts and tool schemas", "user": "user messages",
              "assistant": "assistant messages", "tool": "tool outputs",
              "developer": "developer messages", "other": "text outside the messages"}

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1000px; margin: 2em auto; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.25em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1em; margin-bottom: 0.2em; }
figure { margin: 0.5em 0 1.5em 0; } figure svg { max-width: 100%; height: auto; }
p.summary { font-size: 1.05em; line-height: 1.5; background: #f6f6f6; padding: 0.8em; }
"""


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def summary(report: dict) -> str:
    """The log's figures in a few plain sentences."""
    c, p = report["characterisation"], report["replay"]
    default = p["default"]
    sentences = [
        f"{report['requests']:,} requests, {report['prompt_tokens']:,} prompt tokens in "
        f"{c['sessions']:,} sessions.",
        f"An exact-prefix cache serves {_pct(default['exact_prefix'])} of the prompt tokens; "
        f"Irminsul would add {100 * default['pic_unique']:.1f} points, serving "
        f"{_pct(default['total'])} in all.",
        f"{_pct(c['shifted'])} of the prompt tokens are shifted (seen before, at another "
        f"position: {_pct(c['shifted_within'])} within a session, {_pct(c['shifted_cross'])} "
        "across sessions).",
    ]
    if c["shifted"]:
        # PIC can pass 100% of it: it also reuses repeats shorter than the 64-token windows.
        sentences.append(
            f"The engine's planner serves the equivalent of "
            f"{_pct(default['pic_unique'] / c['shifted'])} of that (the paper's Algorithm 1: "
            f"{_pct(p['algorithm1']['pic_unique'] / c['shifted'])}).")
    roles = c.get("shifted_by_role", {})
    total = sum(v["within"] + v["cross"] for v in roles.values())
    if total:
        ranked = sorted(roles.items(), key=lambda kv: -(kv[1]["within"] + kv[1]["cross"]))
        parts = [f"{ROLE_NAMES.get(role, role)} ({_pct(share)})" for role, v in ranked[:3]
                 if (share := (v["within"] + v["cross"]) / total) >= 0.001]
        sentences.append("The biggest sources of shifted content are " + ", ".join(parts) + ".")
    sentences.append(f"{_pct(c['novel'])} of the prompt tokens are new: no cache can serve them.")
    return " ".join(sentences)


def _name(report: dict) -> str:
    return report.get("name") or str(report["log"]).rsplit("/", 1)[-1]


def render_html(reports: Sequence[dict]) -> str:
    """The page for one or more logs' reports."""
    body = ["<h1>Irminsul: what a position-independent KV cache would serve</h1>"]
    for report in reports:
        body.append(f"<section class='log'><h2>{html.escape(_name(report))}</h2>")
        body.append(f"<p class='summary'>{html.escape(summary(report))}</p>")
        for title, draw in CHARTS:
            body.append(f"<figure class='chart'><h3>{html.escape(title)}</h3>{draw(report)}"
                        "</figure>")
        body.append("</section>")
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            "<title>irminsul analyze</title>"
            f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>\n")
