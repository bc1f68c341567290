"""Run a study by name on a model directory and write ``<study>.json`` and ``<study>.png``
(what ``irminsul study`` does; the CLI only parses options)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..model import load_model
from ..traffic.render import ChatRenderer
from .consistency import (
    ConsistencySettings,
    consistency_study,
    plot_consistency,
    render_consistency_study,
)
from .hijack import HijackSettings, hijack_study, plot_hijack, render_hijack
from .plot import write_json
from .roc import RocSettings, plot_roc, render_roc, roc_study
from .sink import SinkSettings, plot_sink, render_sink, sink_study
from .text import AgentText

STUDIES = ("roc", "sink", "consistency", "hijack")


def run_study(study: str, model_dir: Path, out: Path, *, options: dict | None = None,
              dtype: torch.dtype = torch.float32, device: str = "cpu",
              progress: bool = False) -> tuple[str, dict]:
    """Run ``study`` with its settings' ``options`` (e.g. ``{"blocks": 500}``); write its JSON and
    PNG into ``out``; return the text table and the JSON report."""
    if study not in STUDIES:
        raise ValueError(f"unknown study {study!r}; choose from {', '.join(STUDIES)}")
    options = {k: v for k, v in (options or {}).items() if v is not None}
    model = load_model(model_dir, dtype=dtype, device=device)
    renderer = ChatRenderer.from_dir(model_dir)
    name = model_dir.name
    if study == "roc":
        settings = RocSettings(**options)
        text = AgentText.from_logs(renderer, contexts=settings.contexts)
        result = roc_study(model, text, settings, model_name=name)
        plot, render = plot_roc, render_roc
    elif study == "sink":
        settings = SinkSettings(**options)
        text = AgentText.from_logs(renderer, contexts=settings.contexts)
        bos = int(text.contexts[0][0])  # every rendered prompt begins with it
        result = sink_study(model, text, bos, settings, model_name=name)
        plot, render = plot_sink, render_sink
    elif study == "hijack":
        result = hijack_study(model, renderer, HijackSettings(**options), model_name=name)
        plot, render = plot_hijack, render_hijack
    else:
        result = consistency_study(model, renderer, ConsistencySettings(**options),
                                   model_name=name, progress=progress)
        plot, render = plot_consistency, render_consistency_study
    out.mkdir(parents=True, exist_ok=True)
    report = result.to_json()
    write_json(report, out / f"{study}.json")
    plot(result, out / f"{study}.png")
    return render(result), report
