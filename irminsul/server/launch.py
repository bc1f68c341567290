"""Build a server from a model directory, and run it with uvicorn (``irminsul serve``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from fastapi import FastAPI

from ..config import ServerConfig
from ..engine import Engine, Scheduler
from ..model import load_model
from ..traffic.render import ChatRenderer
from .app import create_app
from .async_engine import AsyncEngine
from .prompts import stop_token_ids

log = logging.getLogger(__name__)


def resolve_device(config: ServerConfig) -> tuple[str, torch.dtype]:
    """The config's device and dtype, their defaults filled in: cuda when available, and
    bfloat16 there, float32 elsewhere."""
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = config.dtype if config.dtype != "auto" else (
        "bfloat16" if device.startswith("cuda") else "float32")
    return device, getattr(torch, dtype)


def build_server(model_dir: str | os.PathLike, config: ServerConfig | None = None
                 ) -> tuple[FastAPI, AsyncEngine]:
    """Load the model and its tokenizer/chat template from ``model_dir``; return the app and
    its engine (started and stopped by the app's lifespan)."""
    config = config or ServerConfig()
    path = Path(model_dir)
    renderer = ChatRenderer.from_dir(path)  # fails fast without tokenizer.json / a template
    device, dtype = resolve_device(config)
    model = load_model(path, dtype=dtype, device=device)
    engine = AsyncEngine(Scheduler(Engine(model, config.engine)))
    name = config.model_name or path.resolve().name
    stops = stop_token_ids(path, renderer)
    if not stops:
        log.warning("%s: no eos_token_id or eos_token found; generation stops only at "
                    "max_tokens or a stop string", path)
    return create_app(engine, renderer, name, stop_token_ids=stops,
                      default_max_tokens=config.default_max_tokens), engine


def serve(model_dir: str | os.PathLike, config: ServerConfig | None = None) -> None:
    """Build the server and run it until interrupted."""
    import uvicorn

    config = config or ServerConfig()
    app, _ = build_server(model_dir, config)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info")


