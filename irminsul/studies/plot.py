"""matplotlib for the studies: Agg (no display; figures are only written out), fixed PNG
metadata so that a rerun writes the same file for the same figures."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def figure(panels: int, *, width: float = 5.0, height: float = 3.6) -> tuple[plt.Figure, list]:
    """A row of ``panels`` axes without top and right spines."""
    fig, axes = plt.subplots(1, panels, figsize=(width * panels, height))
    axes = list(np.atleast_1d(axes))
    for ax in axes:
        ax.spines[["top", "right"]].set_visible(False)
    return fig, axes


def save_png(fig: plt.Figure, path: Path) -> None:
    """Write the figure as a PNG and close it."""
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120, metadata={"Software": None})
    plt.close(fig)


def write_json(report: dict, path: Path) -> None:
    """Write a study's JSON report."""
    path.write_text(json.dumps(report, indent=1), encoding="utf-8")
