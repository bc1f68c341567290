"""The servers: serve (a model over an OpenAI-compatible HTTP API) and router (a proxy in front of
several of them)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from ..config import (
    MAX_DEFAULT_SLOTS,
    MODES,
    ROUTING_POLICIES,
    EngineConfig,
    ParallelConfig,
    RouterConfig,
    ServerConfig,
    StoreConfig,
)
from .common import (
    ENGINE,
    PARALLEL,
    ROUTER,
    SERVER,
    add_command,
    model_dir_of,
    port,
    positive,
    repair_cache,
    repair_options,
)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the model over an OpenAI-compatible HTTP API until interrupted."""
    if args.tokenizer:
        # The server renders with the checkpoint's own tokenizer and template; taking the option
        # and ignoring it would serve different prompts from the ones asked for.
        raise ValueError("serve renders prompts with the model directory's tokenizer and chat "
                         "template; --tokenizer does not apply to it")
    from ..server import serve  # torch, the model runtime and the web stack load only here

    # benchmark-only, and then only: the plain path calls serve as it always has
    random_weights = {"random_weights": args.random_weights} if "random_weights" in args else {}
    if random_weights and getattr(args, "model", None):
        raise ValueError("--random-weights serves random weights with the embedded model's "
                         "tokenizer; it does not take --model")
    audit = getattr(args, "pic_audit_rate", ENGINE.pic_audit_rate)
    engine = EngineConfig(mode=args.pic, slots=args.slots, kr_slots=args.kr_slots,
                          batch_tokens=args.batch_tokens, chunk_tokens=args.chunk_tokens,
                          max_running=args.max_running, await_shared=args.await_shared,
                          pic_audit_rate=audit,
                          graphs=args.graphs,
                          cache=dataclasses.replace(repair_cache(args), heal=args.heal))
    server = ServerConfig(host=args.host, port=args.port, model_name=args.served_model_name,
                          dtype=args.dtype, device=args.device, keep_fp8=args.keep_fp8,
                          engine=engine, max_request_bytes=args.max_request_bytes,
                          max_waiting=args.max_waiting, body_timeout_s=args.body_timeout,
                          kv_memory=args.kv_memory,
                          gate=None if args.no_gate else SERVER.gate,
                          warmup=args.warmup, index_token=_index_token(args),
                          store=StoreConfig(url=args.store,
                                            prefill_tokens_per_second=args.store_prefill_rate,
                                            model_id=args.store_model_id))
    if args.tensor_parallel > 1 and args.data_parallel > 1:
        raise ValueError("--tensor-parallel and --data-parallel split attention two ways; "
                         "give one of them (tensor-parallel groups under data-parallel "
                         "attention are not built)")
    data = args.data_parallel > 1
    parallel = ParallelConfig(world_size=args.data_parallel if data else args.tensor_parallel,
                              attention="data" if data else "tensor",
                              timeout_s=args.collective_timeout)
    return serve(model_dir_of(args), server, parallel=parallel, **random_weights)


def cmd_router(args: argparse.Namespace) -> None:
    """Route OpenAI requests to the irminsul serve backend that holds most of their tokens."""
    if args.tokenizer:
        raise ValueError("the router renders prompts as the backends do, with the model "
                         "directory's tokenizer and chat template (--model); --tokenizer does "
                         "not apply to it")
    from ..router.app import serve_router  # the web stack loads only here

    config = RouterConfig(backends=tuple(args.backend), host=args.host, port=args.port,
                          policy=args.policy, poll_interval_s=args.poll_interval,
                          queue_weight=args.queue_weight, kv_weight=args.kv_weight,
                          tie_margin=args.tie_margin, max_request_bytes=args.max_request_bytes,
                          body_timeout_s=args.body_timeout, index_token=_index_token(args))
    serve_router(config, model_dir_of(args))


def _index_token(args: argparse.Namespace) -> str | None:
    """--index-token, else $IRMINSUL_INDEX_TOKEN (kept out of the process list), else None."""
    return args.index_token or os.environ.get("IRMINSUL_INDEX_TOKEN") or None


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add router and serve to the ``irminsul`` subparsers ``sub``."""
    _router_options(add_command(sub, "router", "an OpenAI-compatible proxy that sends each "
                             "request to the irminsul serve backend holding most of its tokens",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter))

    serve = add_command(sub, "serve", "serve a model over an OpenAI-compatible HTTP API",
                     tokenizer=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--model", metavar="DIR|REPO", default=argparse.SUPPRESS,
                       help="Hugging Face checkpoint directory (config.json, safetensors, "
                            "tokenizer.json and a chat template) or Hub repo id[@revision], "
                            "fetched into the Hugging Face cache unless HF_HUB_OFFLINE is set "
                            "(default: the embedded default model)")
    serve.add_argument("--random-weights", metavar="CONFIG_JSON", default=argparse.SUPPRESS,
                       help="benchmark-only, instead of --model: random weights of this "
                            "config.json's shapes made on the device, with the embedded model's "
                            "tokenizer and chat template (its 8,192 ids must fit the config's "
                            "vocab_size); the output rows past them and of the stop tokens are "
                            "zero, so greedy replies are decodable noise that runs to "
                            "max_tokens; the timing is real")
    serve.add_argument("--host", default=SERVER.host, help="address to listen on")
    serve.add_argument("--port", type=port, default=SERVER.port, help="port to listen on")
    serve.add_argument("--pic", choices=MODES, default=ENGINE.mode,
                       help="position-independent caching: off (exact prefix only), observer "
                            "(record would-be hits), live (serve them)")
    serve.add_argument("--slots", type=int, default=ENGINE.slots,
                       help=f"KV pool size in tokens (default: on CUDA, --kv-memory of the "
                            f"GPU memory the weights leave; else 4x the context, at most "
                            f"{MAX_DEFAULT_SLOTS:,})")
    serve.add_argument("--kv-memory", type=float, default=SERVER.kv_memory, metavar="F",
                       help=f"share of the GPU memory left after the weights that the KV pool "
                            f"takes when --slots is not given (default {SERVER.kv_memory})")
    serve.add_argument("--kr-slots", type=int, default=ENGINE.kr_slots,
                       help="k_r slots (None: as many as --slots): sessions reusing shifted "
                            "content share c_KV rows but each hold their own k_r rows (1/9 of a "
                            "c_KV row's bytes), so more k_r slots hold more of them in the same "
                            "memory")
    serve.add_argument("--batch-tokens", type=int, default=ENGINE.batch_tokens,
                       help="tokens per forward: decode tokens first, then prefill spans")
    serve.add_argument("--chunk-tokens", type=int, default=ENGINE.chunk_tokens,
                       help="prompt tokens one request prefills per forward")
    serve.add_argument("--max-running", type=int, default=ENGINE.max_running,
                       help="requests admitted at once (None: no cap but the KV pool's room "
                            "and --batch-tokens)")
    serve.add_argument("--pic-audit-rate", type=float, default=argparse.SUPPRESS,
                       metavar="R", help=f"live mode: the share of PIC-served requests "
                       f"recomputed from scratch when the engine is idle, their first-token "
                       f"KL exported as irminsul:pic_audit_kl (0: none; default "
                       f"{ENGINE.pic_audit_rate})")
    repair_options(serve)
    serve.add_argument("--heal", action="store_true",
                       help="live mode: rows a finished request reused are recomputed when the "
                            "engine is idle and replace the reused ones in the cache, so later "
                            "turns build on exact rows (spends idle compute; docs/quality.md)")
    serve.add_argument("--await-shared", type=int, default=ENGINE.await_shared, metavar="N",
                       help="a request that would compute at least N tokens a prefill in flight "
                            "is computing waits for it to land, then reuses them (0: never)")
    serve.add_argument("--tensor-parallel", type=positive, default=1, metavar="N",
                       help="ranks: this process serves as rank 0 and starts N-1 more, one per "
                            "GPU (cuda:0 .. N-1 from --device's index; on a CPU, gloo), each "
                            "keeping 1/N of the attention heads, MLP widths and routed experts "
                            "(docs/multi-gpu.md); a rank that fails stops the server")
    serve.add_argument("--data-parallel", type=positive, default=1, metavar="N",
                       help="ranks with data-parallel attention: N servers, one per GPU (as "
                            "--tensor-parallel places them), each with every attention head, "
                            "its own requests and KV cache and 1/N of the routed experts, their "
                            "MoE layers exchanging tokens in lockstep; this process routes each "
                            "request to the rank whose cache holds most of it (the router's "
                            "content policy; docs/multi-gpu.md); a rank that fails stops the "
                            "server")
    serve.add_argument("--collective-timeout", type=float, default=PARALLEL.timeout_s,
                       metavar="S", help="--tensor-parallel, --data-parallel: a collective "
                       "(an all-reduce, an exchange, the leader's message) that waits longer "
                       "than this for a peer rank fails, and the server stops with an error "
                       "naming the rank, instead of hanging")
    serve.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                       default=SERVER.dtype,
                       help="weights and KV (auto: bfloat16 on CUDA, else float32)")
    serve.add_argument("--device", default=SERVER.device,
                       help="torch device (None: cuda when available, else cpu)")
    serve.add_argument("--keep-fp8", action="store_true",
                       help="keep an FP8 checkpoint's weights float8 with their block scales "
                            "(linears and routed experts; half of bf16's memory) instead of "
                            "dequantizing them at load")
    serve.add_argument("--served-model-name", default=SERVER.model_name, metavar="NAME",
                       help="the model name clients send (None: the directory's name)")
    serve.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=SERVER.warmup,
                       help="before listening, run a few synthetic requests through the engine "
                            "(kernels compiled, attention planned for long prompts, PIC and "
                            "sampling), then empty its cache (None: on CUDA only)")
    serve.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=ENGINE.graphs,
                       help="replay CUDA graphs for decode steps, short spans and prefill "
                            "chunks of up to 2K tokens (--no-graphs: every forward eagerly; "
                            "default: on CUDA with a bfloat16 or FP8-kept model, on one GPU; "
                            "under --tensor-parallel / --data-parallel only with --graphs, "
                            "not yet run on several GPUs)")
    serve.add_argument("--max-request-bytes", type=int, default=SERVER.max_request_bytes,
                       metavar="N", help="refuse larger request bodies (413) before reading "
                                         "them whole (None: 1 MiB + 32 bytes per token of "
                                         "context)")
    serve.add_argument("--max-waiting", type=int, default=SERVER.max_waiting, metavar="N",
                       help="requests waiting for their first token beyond --max-running; "
                            "more get 429 with Retry-After")
    serve.add_argument("--body-timeout", type=float, default=SERVER.body_timeout_s,
                       metavar="S", help="a request body not all received in S seconds gets "
                                         "408 (a stalled upload gives back its place)")
    serve.add_argument("--no-gate", action="store_true",
                       help="serve live PIC without the correctness gate (by default a live "
                            "server first runs irminsul gate on the checkpoint, cached per "
                            "checkpoint, and serves exact prefixes only if it refuses); logged "
                            "as a warning")
    serve.add_argument("--index-token", default=None, metavar="TOKEN",
                       help="answer GET /irminsul/index only to 'Authorization: Bearer TOKEN' "
                            "(give routers --index-token too; default $IRMINSUL_INDEX_TOKEN, "
                            "else the index is public: it lets anyone test whether unsalted "
                            "content is cached)")
    serve.add_argument("--store", default=SERVER.store.url, metavar="URL",
                       help="a content store shared with other engines, redis://HOST:PORT "
                            "(Redis or Valkey): registered chunks are published to it, and "
                            "missed ones fetched from it when that beats prefilling them "
                            "(docs/scale-out.md)")
    serve.add_argument("--store-prefill-rate", type=float,
                       default=SERVER.store.prefill_tokens_per_second, metavar="TOKENS_PER_S",
                       help="the store's cost model: this engine's prefill rate, against which "
                            "a fetch's bytes over the measured link bandwidth are weighed")
    serve.add_argument("--store-model-id", default=SERVER.store.model_id, metavar="NAME",
                       help="the model's name in the store's keys: engines share values only "
                            "under the same one (default: a hash of the config, the KV dtype "
                            "and a sample of the weights; the same at any --tensor-parallel "
                            "up to 8)")
    serve.set_defaults(func=cmd_serve)


def _router_options(parser: argparse.ArgumentParser) -> None:
    """Options of irminsul router."""
    parser.add_argument("--backend", action="append", required=True, metavar="URL",
                        help="an irminsul serve backend, http://HOST:PORT; once per backend")
    parser.add_argument("--model", metavar="DIR|REPO", default=argparse.SUPPRESS,
                        help="the backends' checkpoint directory or Hub repo id, for its "
                             "tokenizer and chat template (default: the embedded default model)")
    parser.add_argument("--host", default=ROUTER.host, help="address to listen on")
    parser.add_argument("--port", type=port, default=ROUTER.port, help="port to listen on")
    parser.add_argument("--policy", choices=ROUTING_POLICIES, default=ROUTER.policy,
                        help="content: the exact prefix, then content-defined chunks; prefix: "
                             "the exact prefix only; round_robin: each backend in turn")
    parser.add_argument("--index-token", default=None, metavar="TOKEN",
                        help="the backends' --index-token, sent with each index poll "
                             "(default $IRMINSUL_INDEX_TOKEN)")
    parser.add_argument("--poll-interval", type=float, default=ROUTER.poll_interval_s,
                        metavar="S", help="seconds between polls of each backend's index")
    parser.add_argument("--queue-weight", type=float, default=ROUTER.queue_weight,
                        metavar="W", help="score: cost of each request in flight on a backend, "
                                          "in shares of the prompt served from cache")
    parser.add_argument("--kv-weight", type=float, default=ROUTER.kv_weight, metavar="W",
                        help="score: cost of a backend's full KV pool, in shares of the prompt")
    parser.add_argument("--tie-margin", type=float, default=ROUTER.tie_margin, metavar="M",
                        help="scores this close to the best tie (then the session's last "
                             "backend, else a hash of the session or prompt, wins)")
    parser.add_argument("--max-request-bytes", type=int, default=ROUTER.max_request_bytes,
                        metavar="N", help="refuse larger request bodies (413) before reading "
                                          "them whole")
    parser.add_argument("--body-timeout", type=float, default=ROUTER.body_timeout_s,
                        metavar="S", help="a request body not all received in S seconds gets "
                                          "408")
    parser.set_defaults(func=cmd_router)
