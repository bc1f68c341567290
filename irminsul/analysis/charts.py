"""The charts of one log's ``analyze`` report, drawn with matplotlib as inline SVG.

Each function takes the log's JSON report (the source of truth) and returns one chart as an SVG
string, text kept as text (``svg.fonttype = none``) so the page is small and searchable.
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # no display: figures are only ever written out

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .recoverability import MASK_SWEEP  # noqa: E402
from .replay import STRATEGIES  # noqa: E402

# One colour per source of a prompt token, the same in every chart.
COLOURS = {"exact_prefix": "#4C72B0", "shifted_within": "#DD8452", "shifted_cross": "#C44E52",
           "pic_unique": "#DD8452", "novel": "#BBBBBB"}
LABELS = {"exact_prefix": "exact prefix", "shifted_within": "shifted, same session",
          "shifted_cross": "shifted, other session", "novel": "novel",
          "pic_unique": "Irminsul (PIC)"}
SPLIT = ("exact_prefix", "shifted_within", "shifted_cross", "novel")


def _svg(fig: plt.Figure) -> str:
    buffer = io.StringIO()
    with plt.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # inline: no XML prologue or doctype


def _figure(width: float = 7.0, height: float = 2.8) -> tuple[plt.Figure, plt.Axes]:
    fig, ax = plt.subplots(figsize=(width, height))
    ax.spines[["top", "right"]].set_visible(False)
    return fig, ax


def _percent_axis(axis: matplotlib.axis.Axis) -> None:
    axis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))


def token_split(report: dict) -> str:
    """All prompt tokens split into exact prefix / shifted (within, cross) / novel: one bar."""
    c = report["characterisation"]
    fig, ax = _figure(height=1.3)
    left = 0.0
    for key in SPLIT:
        ax.barh([0], [c[key]], left=left, color=COLOURS[key], label=LABELS[key])
        if c[key] >= 0.04:
            ax.text(left + c[key] / 2, 0, f"{100 * c[key]:.1f}%", ha="center", va="center",
                    fontsize=8)
        left += c[key]
    ax.set_xlim(0, 1)
    ax.set_yticks([])
    _percent_axis(ax.xaxis)
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
    return _svg(fig)


def _session_shares(report: dict) -> np.ndarray:
    """Per session: exact-prefix, within, cross, novel shares of its prompt tokens."""
    counts = np.asarray(report["characterisation"]["session_tokens"]["counts"],
                        dtype=float).reshape(-1, 4)
    prompt = np.maximum(counts[:, :1], 1)
    shares = counts[:, 1:] / prompt
    return np.column_stack([shares, 1 - shares.sum(axis=1)])


def session_split(report: dict) -> str:
    """The same split per session, sessions ordered by their shifted share."""
    shares = _session_shares(report)
    order = np.argsort(shares[:, 1] + shares[:, 2], kind="stable")
    shares = shares[order]
    fig, ax = _figure()
    x, bottom = np.arange(len(shares)), np.zeros(len(shares))
    for k, key in enumerate(SPLIT):
        ax.bar(x, shares[:, k], bottom=bottom, width=1.0, color=COLOURS[key], label=LABELS[key],
               linewidth=0)
        bottom += shares[:, k]
    ax.set_xlim(-0.5, len(shares) - 0.5)
    ax.set_ylim(0, 1)
    _percent_axis(ax.yaxis)
    ax.set_xlabel(f"{len(shares):,} sessions, by shifted share")
    ax.set_ylabel("share of the session's\nprompt tokens")
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), frameon=False)
    return _svg(fig)


def session_distribution(report: dict) -> str:
    """How the sessions' exact-prefix and shifted shares are distributed (histograms)."""
    shares = _session_shares(report)
    fig, ax = _figure()
    bins = np.linspace(0, 1, 41)
    ax.hist(shares[:, 0], bins=bins, color=COLOURS["exact_prefix"], alpha=0.7,
            label="exact prefix")
    ax.hist(shares[:, 1] + shares[:, 2], bins=bins, color=COLOURS["shifted_cross"], alpha=0.7,
            label="shifted")
    _percent_axis(ax.xaxis)
    ax.set_xlabel("share of a session's prompt tokens")
    ax.set_ylabel("sessions")
    ax.legend(fontsize=8, frameon=False)
    return _svg(fig)


def recoverability(report: dict) -> str:
    """What each strategy recovers: the probes over non-prefix tokens, and the replay's
    PIC-served share of all prompt tokens per strategy."""
    r, p = report["recoverability"], report["replay"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 2.8), width_ratios=[3, 7])
    probes = {"fixed 128-token\nblocks": r["fixed_block"], "CDC": r["cdc"],
              "CDC + S1": r["cdc_fallback"]}
    left.bar(list(probes), list(probes.values()), color="#8172B3")
    left.set_title("share of non-prefix tokens found", fontsize=9)
    names = list(STRATEGIES)
    values = [p[s]["pic_unique"] for s in names]
    colours = ["#DD8452" if s == p["default"]["strategy"] else "#937860" for s in names]
    right.bar(names, values, color=colours)
    right.axhline(report["characterisation"]["shifted"], color=COLOURS["shifted_cross"],
                  linestyle="--", linewidth=1, label="shifted (64-token windows)")
    right.set_title("replay: share of prompt tokens served by PIC", fontsize=9)
    right.legend(fontsize=8, frameon=False)
    for ax in (left, right):
        ax.spines[["top", "right"]].set_visible(False)
        ax.tick_params(axis="x", labelsize=8)
        _percent_axis(ax.yaxis)
    return _svg(fig)


def mask_sweep(report: dict) -> str:
    """CDC recovery of non-prefix tokens by mask bits k (expected chunk size 2^k)."""
    sweep = report["recoverability"]["mask_sweep"]
    ks = list(MASK_SWEEP)
    fig, ax = _figure()
    ax.plot(ks, [sweep[str(k)] for k in ks], marker="o", color="#8172B3")
    ax.set_xticks(ks)
    ax.set_xlabel("mask bits k (chunks of ~2^k tokens)")
    ax.set_ylabel("non-prefix tokens\nfound by CDC")
    _percent_axis(ax.yaxis)
    return _svg(fig)


def served_over_time(report: dict) -> str:
    """The default replay's served shares along the log: warm-up, then steady state."""
    t = report["replay"]["timeline"]
    x = np.asarray(t["request_end"])
    prefix, pic = np.asarray(t["exact_prefix"]), np.asarray(t["pic_unique"])
    fig, ax = _figure()
    ax.stackplot(x, prefix, pic, colors=[COLOURS["exact_prefix"], COLOURS["pic_unique"]],
                 labels=[LABELS["exact_prefix"], LABELS["pic_unique"]], step="pre")
    ax.set_xlim(0, x[-1] if x.size else 1)
    # From the lowest tenth the exact prefix reaches: the PIC band on top of a high prefix share
    # would be a hairline on a full 0-100% axis.
    low = np.floor(10 * prefix.min()) / 10 if prefix.size else 0.0
    ax.set_ylim(low, 1)
    ax.set_xlabel("requests, in log order")
    ax.set_ylabel("prompt tokens served" + (f"\n(axis from {100 * low:.0f}%)" if low else ""))
    _percent_axis(ax.yaxis)
    ax.legend(fontsize=8, loc="lower right", frameon=False)
    return _svg(fig)


# Title and function of each chart, in page order.
CHARTS = (
    ("Where the prompt tokens could come from", token_split),
    ("Per session", session_split),
    ("Distribution over sessions", session_distribution),
    ("Recoverability by strategy", recoverability),
    ("Mask-bits sweep", mask_sweep),
    ("Served share over time (replay of the engine's planner)", served_over_time),
)
