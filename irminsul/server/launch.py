"""Build a server from a model directory, and run it with uvicorn (``irminsul serve``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from fastapi import FastAPI

from .. import __version__
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
    # fails fast without tokenizer.json / a template
    renderer = ChatRenderer.from_dir(path, memo_bytes=config.render_memo_bytes)
    device, dtype = resolve_device(config)
    model = load_model(path, dtype=dtype, device=device)
    scheduler = Scheduler(Engine(model, config.engine))
    engine = AsyncEngine(scheduler)
    name = config.model_name or path.resolve().name
    stops = stop_token_ids(path, renderer)
    if not stops:
        log.warning("%s: no eos_token_id or eos_token found; generation stops only at "
                    "max_tokens or a stop string", path)
    log.info("%s", startup_line(name, path, config, scheduler, device, dtype))
    return create_app(engine, renderer, name, stop_token_ids=stops, config=config), engine


def startup_line(name: str, path: Path, config: ServerConfig, scheduler: Scheduler, device: str,
                 dtype: torch.dtype) -> str:
    """What an operator wants to see once at start: what runs, with what memory, and the
    model id clients must send."""
    engine = scheduler.engine
    pool, runner = engine.pool, engine.runner
    graphs = (f"CUDA graphs for {', '.join(map(str, runner.graphs.buckets))} tokens"
              if runner.graphs is not None else "no CUDA graphs")
    context = scheduler.limits.context
    return (f"irminsul {__version__}: serving {path} as model id '{name}' | PIC "
            f"{engine.config.mode} | {device} {str(dtype).removeprefix('torch.')}, "
            f"{'Triton' if runner.kernels else 'torch'} kernels, {graphs} | KV pool "
            f"{pool.num_slots} c_KV + {pool.num_kr_slots} k_r slots | context {context} "
            f"tokens | up to {scheduler.max_running} running + {config.max_waiting} waiting, "
            f"bodies up to {config.request_bytes_for(context)} bytes")


def serve(model_dir: str | os.PathLike, config: ServerConfig | None = None) -> None:
    """Build the server and run it until interrupted."""
    import uvicorn

    config = config or ServerConfig()
    logging.getLogger("irminsul").setLevel(logging.INFO)  # the startup line, at least
    app, _ = build_server(model_dir, config)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info")


