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
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from fastapi import FastAPI

from .. import __version__
from ..config import AttentionMode, EngineConfig, ParallelConfig, ServerConfig
from ..engine import Engine, Scheduler
from ..engine.kv_pool import free_device_memory, slots_for_memory
from ..engine.warmup import warm_up
from ..model import MLAModel, load_config, load_model
from ..model.random_weights import random_model as random_weights_model
from ..traffic.render import ChatRenderer
from .app import create_app
from .async_engine import AsyncEngine
from .prompts import stop_token_ids

if TYPE_CHECKING:
    from ..quality import GateResult

log = logging.getLogger(__name__)


def resolve_device(config: ServerConfig) -> tuple[str, torch.dtype]:
    """The config's device and dtype, their defaults filled in: cuda when available, and
    bfloat16 there, float32 elsewhere."""
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = config.dtype if config.dtype != "auto" else (
        "bfloat16" if device.startswith("cuda") else "float32")
    return device, getattr(torch, dtype)


def random_model(config_json: str | os.PathLike, *, vocab: int, device: str,
                 dtype: torch.dtype, never: Sequence[int] = (), keep_fp8: bool = False,
                 share: tuple[int, int] | None = None,
                 attention: AttentionMode = "tensor") -> MLAModel:
    """Benchmark-only: the shapes of ``config_json`` with random weights made on the device
    (normal, std 0.02; norms 1; routers float32, as the loader keeps them). The output-embedding
    rows of the ids ``never`` (the stop tokens) and of those past the tokenizer's ``vocab`` are
    zero, so greedy decoding never picks them (a score of 0 against the max of thousands of
    random ones): it generates text the tokenizer decodes, and exactly ``max_tokens`` of it.
    ``keep_fp8``: float8 weights with block scales, as an FP8 checkpoint kept so; ``share``:
    (rank, ranks), only that rank's share is made (under ``attention``'s split; replicated
    weights are the same on every rank). ValueError if the tokenizer has more ids than the config's
    vocabulary."""
    config = load_config(config_json)
    if vocab > config.vocab_size:
        raise ValueError(f"{config_json}: vocab_size {config.vocab_size} is smaller than the "
                         f"tokenizer's {vocab} ids; prompt ids would fall outside the embedding")
    prepare = None
    if share is not None:
        from ..parallel.shard import shard_weights

        def prepare(model: MLAModel) -> None:
            shard_weights(model, *share, attention)

    model = random_weights_model(config, device, dtype, keep_fp8=keep_fp8, prepare=prepare)
    with torch.no_grad():
        model.lm_head.weight[vocab:].zero_()
        model.lm_head.weight[list(never)] = 0.0
    return model


def build_server(model_dir: str | os.PathLike, config: ServerConfig | None = None, *,
                 random_weights: str | os.PathLike | None = None,
                 make_engine: Callable[..., Engine] = Engine,
                 load: Callable[..., MLAModel] | None = None,
                 random_share: tuple[int, int] | None = None,
                 attention: AttentionMode = "tensor"
                 ) -> tuple[FastAPI, AsyncEngine]:
    """Load the model and its tokenizer/chat template from ``model_dir``; return the app and
    its engine (started and stopped by the app's lifespan). With ``random_weights`` (a
    config.json; benchmark-only) the model is :func:`random_model` of it and ``model_dir``
    gives only the tokenizer, chat template and stop tokens. ``make_engine`` builds the engine
    from the loaded model and the sized engine config, and the PIC gate's engines before it
    (``Engine``'s signature): tensor parallel's leader opens them on every rank's shard
    (:mod:`irminsul.parallel.serving`). ``load`` reads the checkpoint (path, dtype=, device=)
    instead of ``load_model``: tensor parallel's leader reads only its share; ``random_share``:
    (rank, ranks) of random weights, its share alone made (:func:`random_model`), under
    ``attention``'s split."""
    config = config or ServerConfig()
    path = Path(model_dir)
    # fails fast without tokenizer.json / a template
    renderer = ChatRenderer.from_dir(path, memo_bytes=config.render_memo_bytes)
    device, dtype = resolve_device(config)
    stops = stop_token_ids(path, renderer)
    if random_weights is None:
        vocab, ids = load_config(path).vocab_size, renderer.tokenizer.get_vocab_size(True)
        if ids > vocab:  # before the weights are read: a mismatch is found in seconds
            raise ValueError(f"{path}: config.json's vocab_size {vocab} is smaller than the "
                             f"tokenizer's {ids} ids; prompt ids would fall outside the "
                             "embedding")
        load = load or partial(load_model, keep_fp8=config.keep_fp8)
        model = load(path, dtype=dtype, device=device)
        name, shown = config.model_name or path.resolve().name, str(path)
    else:
        source = Path(random_weights)
        model = random_model(source, vocab=renderer.tokenizer.get_vocab_size(True),
                             device=device, dtype=dtype, never=stops, keep_fp8=config.keep_fp8,
                             share=random_share, attention=attention)
        # "config.json" says nothing: name the model after its directory
        label = source.resolve().parent.name if source.name == "config.json" else source.stem
        name = config.model_name or f"random-{label}"
        shown = f"random weights of {source} (tokenizer and template of {path})"
    gate, note = pic_gate(path, model, renderer, config, random_weights=random_weights is not None,
                          open_engine=make_engine)
    if gate is not None and not gate.passed:
        config = replace(config, engine=replace(config.engine, mode="off"))
    scheduler = Scheduler(make_engine(model, _sized_pool(config, model, device)))
    if config.warmup if config.warmup is not None else device.startswith("cuda"):
        # Before the store is attached: nothing of the warm-up is published.
        report = warm_up(scheduler)
        log.info("warm-up: %d requests, %d prompt tokens (%d by exact prefix, %d by PIC) in "
                 "%.1f s; cache emptied", report.requests, report.prompt_tokens,
                 report.prefix_tokens, report.pic_tokens, report.seconds)
    if config.store.url is not None:
        from ..store import attach  # the Redis client loads only with a store

        attach(scheduler.engine, config.store)
    engine = AsyncEngine(scheduler)
    if not stops:
        log.warning("%s: no eos_token_id or eos_token found; generation stops only at "
                    "max_tokens or a stop string", path)
    log.info("%s", startup_line(name, shown, config, scheduler, device, dtype, gate=note))
    return create_app(engine, renderer, name, stop_token_ids=stops, config=config,
                      gate=gate), engine


def pic_gate(path: Path, model: MLAModel, renderer: ChatRenderer, config: ServerConfig, *,
             random_weights: bool, open_engine: Callable[..., Engine] = Engine
             ) -> tuple[GateResult | None, str]:
    """The PIC correctness gate (:mod:`irminsul.quality.gate`) before a live server serves:
    the result (None where it did not run) and the startup line's note on it. It runs only in
    live mode (off and observer serve no reuse), is skipped for random weights (KL against
    noise means nothing) and by the operator's ``--no-gate`` (config.gate None), and is cached
    per checkpoint. A gate that fails to run refuses: it cannot vouch for reuse.
    ``open_engine``: builds the gate's engines (tensor parallel's leader: on every rank)."""
    if config.engine.mode != "live":
        return None, ""
    if random_weights:
        log.info("PIC gate skipped: random weights (benchmark-only) make its KL figures "
                 "meaningless")
        return None, " (gate skipped: random weights)"
    if config.gate is None:
        log.warning("PIC gate disabled by the operator (--no-gate): serving live PIC on %s "
                    "without checking that reuse is safe for this checkpoint", path)
        return None, " (gate off)"
    from ..quality import checkpoint_hash, judge, run_gate

    start, checkpoint = time.monotonic(), ""
    try:
        checkpoint = checkpoint_hash(path)
        result = run_gate(model, renderer, checkpoint, config.gate, engine=config.engine,
                          open_engine=open_engine)
    except Exception as err:  # whatever stops the gate, the verdict is "refused"
        log.exception("PIC gate failed on %s", path)
        result = replace(judge(checkpoint, (), config.gate), reason=f"the gate failed: {err!r}")
    finally:
        if torch.device(config.device or "cpu").type == "cuda":
            torch.cuda.empty_cache()  # the gate's pools, before the serving pool is sized
    how = "cached result" if result.cached else f"measured in {time.monotonic() - start:.1f} s"
    if result.passed:
        log.info("PIC gate passed for %s (%s): %s", path, how, result.reason)
        return result, " (gate passed)"
    log.warning("PIC gate refused live reuse for %s (%s): %s; serving exact prefixes only (PIC "
                "off). `irminsul gate --model %s` prints the figures; --no-gate overrides",
                path, how, result.reason, path)
    return result, " (gate refused live)"


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
                 device: str, dtype: torch.dtype, *, gate: str = "") -> str:
    """What an operator wants to see once at start: what runs, with what memory, and the
    model id clients must send. ``gate``: the PIC gate's note after the mode (:func:`pic_gate`)."""
    engine = scheduler.engine
    pool, runner = engine.pool, engine.runner
    graphs = (f"CUDA graphs for {', '.join(map(str, runner.graphs.buckets))} tokens"
              if runner.graphs is not None else "no CUDA graphs")
    context = scheduler.limits.context
    store = engine.cache.store
    shared = ("" if store is None else
              f" | shared store {store.config.url} (model id {store.shape.model_id:016x})")
    return (f"irminsul {__version__}: serving {path} as model id '{name}' | PIC "
            f"{engine.config.mode}{gate} | {device} {str(dtype).removeprefix('torch.')}, "
            f"{'Triton' if runner.kernels else 'torch'} kernels, {graphs} | KV pool "
            f"{pool.num_slots} c_KV + {pool.num_kr_slots} k_r slots | context {context} "
            f"tokens | up to {scheduler.max_running} running + {config.max_waiting} waiting, "
            f"bodies up to {config.request_bytes_for(context)} bytes{shared}")


def serve(model_dir: str | os.PathLike, config: ServerConfig | None = None, *,
          random_weights: str | os.PathLike | None = None,
          parallel: ParallelConfig | None = None) -> int:
    """Build the server (see :func:`build_server`) and run it until interrupted; returns the
    exit status. ``parallel`` with more than one rank: this process is rank 0 of a
    tensor-parallel server (:func:`irminsul.parallel.serving.serve_tensor_parallel`), or, under
    data-parallel attention, the router in front of a server per rank
    (:func:`irminsul.parallel.data_serving.serve_data_parallel`)."""
    import uvicorn

    config = config or ServerConfig()
    logging.getLogger("irminsul").setLevel(logging.INFO)  # the startup line, at least
    if parallel is not None and parallel.world_size > 1 and parallel.attention == "data":
        from ..parallel.data_serving import serve_data_parallel

        return serve_data_parallel(model_dir, config, parallel, random_weights=random_weights)
    if parallel is not None and parallel.world_size > 1:
        from ..parallel.serving import serve_tensor_parallel

        return serve_tensor_parallel(model_dir, config, parallel, random_weights=random_weights)
    app, _ = build_server(model_dir, config, random_weights=random_weights)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info")
    return 0


