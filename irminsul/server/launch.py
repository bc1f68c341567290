"""Build a server from a model directory, and run it with uvicorn (``irminsul serve``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from fastapi import FastAPI

from ..engine import Engine, Mode, Scheduler
from ..model import load_model
from ..traffic.render import ChatRenderer
from .app import create_app
from .async_engine import AsyncEngine
from .prompts import stop_token_ids

log = logging.getLogger(__name__)

MAX_DEFAULT_SLOTS = 1 << 16  # 64K tokens: ~2 GB of latent rows for DeepSeek-V2-Lite in bf16


def default_slots(context: int) -> int:
    """A KV pool that holds a few full-context requests, capped for long-context models."""
    return min(4 * context, MAX_DEFAULT_SLOTS)


def build_server(model_dir: str | os.PathLike, *, mode: Mode = "live", slots: int | None = None,
                 kr_slots: int | None = None, dtype: torch.dtype = torch.float32,
                 device: str = "cpu",
                 model_name: str | None = None,
                 graphs: bool | None = None) -> tuple[FastAPI, AsyncEngine]:
    """Load the model and its tokenizer/chat template from ``model_dir``; return the app and
    its engine (started and stopped by the app's lifespan). ``slots`` / ``kr_slots``: the
    pool's c_KV and k_r slot spaces (default: :func:`default_slots`; k_r as many as c_KV).
    ``graphs``: as :class:`Engine`'s (None: its default; False: every forward eager)."""
    path = Path(model_dir)
    renderer = ChatRenderer.from_dir(path)  # fails fast without tokenizer.json / a template
    model = load_model(path, dtype=dtype, device=device)
    num_slots = slots or default_slots(model.config.max_position_embeddings)
    engine = AsyncEngine(Scheduler(Engine(model, num_slots=num_slots, num_kr_slots=kr_slots,
                                          mode=mode, graphs=graphs)))
    name = model_name or path.resolve().name
    stops = stop_token_ids(path, renderer)
    if not stops:
        log.warning("%s: no eos_token_id or eos_token found; generation stops only at "
                    "max_tokens or a stop string", path)
    return create_app(engine, renderer, name, stop_token_ids=stops), engine


def serve(model_dir: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 8000,
          **options) -> None:
    """Build the server and run it until interrupted."""
    import uvicorn

    app, _ = build_server(model_dir, **options)
    uvicorn.run(app, host=host, port=port, log_level="info")
