"""Build a server from a model directory, and run it with uvicorn (``irminsul serve``).

Benchmark-only: ``random_weights`` (a config.json) serves that config's shapes with random weights
made on the device, rendering with the model directory's tokenizer and chat template (the
embedded default model's, whose 8,192 ids fit any DeepSeek config's vocabulary). What it
generates is noise, and greedily never a stop token (every reply runs to ``max_tokens``); how
long it takes is what a checkpoint of those shapes takes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from fastapi import FastAPI

from .. import __version__
from ..config import EngineConfig, ServerConfig
from ..engine import Engine, Scheduler
from ..engine.kv_pool import free_device_memory, slots_for_memory
from ..model import MLAModel, load_config, load_model
from ..model.random_weights import random_model as random_weights_model
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


def random_model(config_json: str | os.PathLike, *, vocab: int, device: str,
                 dtype: torch.dtype, never: Sequence[int] = ()) -> MLAModel:
    """Benchmark-only: the shapes of ``config_json`` with random weights made on the device
    (normal, std 0.02; norms 1; routers float32, as the loader keeps them). The output-embedding
    rows of the ids ``never`` (the stop tokens) and of those past the tokenizer's ``vocab`` are
    zero, so greedy decoding never picks them (a score of 0 against the max of thousands of
    random ones): it generates text the tokenizer decodes, and exactly ``max_tokens`` of it.
    ValueError if the tokenizer has more ids than the config's vocabulary."""
    config = load_config(config_json)
    if vocab > config.vocab_size:
        raise ValueError(f"{config_json}: vocab_size {config.vocab_size} is smaller than the "
                         f"tokenizer's {vocab} ids; prompt ids would fall outside the embedding")
    model = random_weights_model(config, device, dtype)
    with torch.no_grad():
        model.lm_head.weight[vocab:].zero_()
        model.lm_head.weight[list(never)] = 0.0
    return model


def build_server(model_dir: str | os.PathLike, config: ServerConfig | None = None, *,
                 random_weights: str | os.PathLike | None = None
                 ) -> tuple[FastAPI, AsyncEngine]:
    """Load the model and its tokenizer/chat template from ``model_dir``; return the app and
    its engine (started and stopped by the app's lifespan). With ``random_weights`` (a
    config.json; benchmark-only) the model is :func:`random_model` of it and ``model_dir``
    gives only the tokenizer, chat template and stop tokens."""
    config = config or ServerConfig()
    path = Path(model_dir)
    # fails fast without tokenizer.json / a template
    renderer = ChatRenderer.from_dir(path, memo_bytes=config.render_memo_bytes)
    device, dtype = resolve_device(config)
    stops = stop_token_ids(path, renderer)
    if random_weights is None:
        model = load_model(path, dtype=dtype, device=device)
        name, shown = config.model_name or path.resolve().name, str(path)
    else:
        source = Path(random_weights)
        model = random_model(source, vocab=renderer.tokenizer.get_vocab_size(True),
                             device=device, dtype=dtype, never=stops)
        # "config.json" says nothing: name the model after its directory
        label = source.resolve().parent.name if source.name == "config.json" else source.stem
        name = config.model_name or f"random-{label}"
        shown = f"random weights of {source} (tokenizer and template of {path})"
    scheduler = Scheduler(Engine(model, _sized_pool(config, model, device)))
    engine = AsyncEngine(scheduler)
    if not stops:
        log.warning("%s: no eos_token_id or eos_token found; generation stops only at "
                    "max_tokens or a stop string", path)
    log.info("%s", startup_line(name, shown, config, scheduler, device, dtype))
    return create_app(engine, renderer, name, stop_token_ids=stops, config=config), engine


def _sized_pool(config: ServerConfig, model: MLAModel, device: str) -> EngineConfig:
    """The engine config, its KV pool sized to ``kv_memory`` of the GPU memory the weights left
    where no size is given (a server owns its GPU, as vLLM's gpu_memory_utilization assumes);
    off a GPU the engine's small default stands."""
    engine = config.engine
    if engine.slots is not None or torch.device(device).type != "cuda":
        return engine
    cfg = model.config
    budget = int(free_device_memory(device) * config.kv_memory)
    slots = slots_for_memory(cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                             model.lm_head.weight.dtype, budget, engine.kr_slots)
    if slots < 1:
        raise ValueError(f"no GPU memory left for the KV pool ({budget:,} bytes at kv_memory "
                         f"{config.kv_memory}); give --slots")
    return replace(engine, slots=slots)


def startup_line(name: str, path: Path | str, config: ServerConfig, scheduler: Scheduler,
                 device: str, dtype: torch.dtype) -> str:
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


def serve(model_dir: str | os.PathLike, config: ServerConfig | None = None, *,
          random_weights: str | os.PathLike | None = None) -> None:
    """Build the server (see :func:`build_server`) and run it until interrupted."""
    import uvicorn

    config = config or ServerConfig()
    logging.getLogger("irminsul").setLevel(logging.INFO)  # the startup line, at least
    app, _ = build_server(model_dir, config, random_weights=random_weights)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info")


