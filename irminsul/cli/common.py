"""What the ``irminsul`` commands share: the defaults --help shows, the global options, the
options of the commands that run a model, and the helpers that find the model, its renderer and
the workload it runs over."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..config import CacheConfig, EngineConfig, GateConfig, ParallelConfig, RouterConfig, ServerConfig
from ..traffic.logs import read_requests, sample_logs, write_requests
from ..traffic.render import ChatRenderer
from ..traffic.workloads import TextPool, build_workload

# the defaults --help shows
ENGINE, SERVER, GATE, PARALLEL = EngineConfig(), ServerConfig(), GateConfig(), ParallelConfig()
ROUTER = RouterConfig()
# Without --workload, bench and consistency run on this pattern built from the shipped samples:
# the partition shift where position-independent reuse pays, sized to take about a minute on two
# CPU cores with the default model.
DEFAULT_WORKLOAD, DEFAULT_HEADER_TOKENS, DEFAULT_REQUESTS = "agent_meta", 250, 12


TOKENIZER_HELP = ("tokenizer directory: a local Hugging Face tokenizer.json with a chat template "
                  "(default: the model's own for bench and consistency, which run a model; else "
                  "the DeepSeek tokenizer with a DeepSeek-V3-style template). serve always uses "
                  "the model's own")


def positive(text: str) -> int:
    """A count option (requests, tokens, slots, ranks): a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def port(text: str) -> int:
    """--port: a TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535, got {value}")
    return value


def global_options(parser: argparse.ArgumentParser, *, top: bool, tokenizer: bool = True) -> None:
    """The options the commands share, taken before or after the command's name alike.

    The top-level parser holds the defaults; each command's parser adds the same options with
    ``SUPPRESS`` defaults, so an option given after the command overrides one given before it,
    and one not given after it leaves the top-level value in place.
    """
    def default(value: object) -> object:
        return value if top else argparse.SUPPRESS

    if tokenizer:
        parser.add_argument("--tokenizer", metavar="DIR", default=default(None),
                            help=TOKENIZER_HELP)
    parser.add_argument("-q", "--quiet", action="store_true", default=default(False),
                        help="no progress bars")


def add_command(sub: argparse._SubParsersAction, name: str, summary: str, *, tokenizer: bool = True,
             **kwargs: object) -> argparse.ArgumentParser:
    """A command's parser with the global options (``tokenizer``: --tokenizer among them);
    ``summary`` is its line in --help."""
    parser = sub.add_parser(name, help=summary, description=summary, **kwargs)
    global_options(parser, top=False, tokenizer=tokenizer)
    return parser


def device_options(parser: argparse.ArgumentParser) -> None:
    """Where a command that runs the model runs it: --device and --dtype."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="torch device to run the model on (default cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and KV (default float32)")


def model_workload_options(parser: argparse.ArgumentParser, *, many: bool) -> None:
    """Options of the commands that run a model over a workload log."""
    parser.add_argument("--model", metavar="DIR|REPO",
                        help="Hugging Face checkpoint directory (config.json + safetensors) or "
                             "Hub repo id[@revision] (default: the embedded default model)")
    # nargs=1 for a single log keeps args.workload a list either way.
    parser.add_argument("--workload", nargs="+" if many else 1, metavar="LOG",
                        help="JSON Lines request log" + ("(s)" if many else "") +
                             f" (default: {DEFAULT_WORKLOAD} built from the shipped samples)")
    parser.add_argument("--json", metavar="OUT", help="write the report as JSON")
    parser.add_argument("--requests", type=positive, default=None,
                        help="first N requests of the log (default: all; the default workload "
                             f"has {DEFAULT_REQUESTS})")
    parser.add_argument("--slots", type=positive, default=None,
                        help="KV pool size per engine in tokens (default: the whole workload, "
                             "so nothing is evicted)")
    device_options(parser)


def repair_options(parser: argparse.ArgumentParser) -> None:
    """--recompute-head, --recompute-share and how its tokens are picked (CacheConfig's repair
    knobs), and --no-sub-windows (which reuse the planner finds), for serve and gate."""
    parser.add_argument("--recompute-head", type=int, default=ENGINE.cache.recompute_head,
                        metavar="K", help="live mode, repair: compute the first K tokens of "
                        "every reused run instead of reusing them (EPIC-style; docs/quality.md "
                        "measures each K; 0: none)")
    parser.add_argument("--recompute-share", type=float, default=ENGINE.cache.recompute_share,
                        metavar="R", help="live mode, repair: compute this share of each "
                        "prompt's reused tokens, those whose latent deviates most from a fresh "
                        "one at an early layer (CacheBlend-style; 0: none)")
    parser.add_argument("--recompute-rule", choices=("deviation", "signed", "recent"),
                        default=ENGINE.cache.recompute_rule,
                        help="how --recompute-share picks its tokens: the largest c_KV "
                        "deviations at the check layer, the largest drops of the prompt "
                        "tail's attention error at layers 1 .. the check layer, or the reused "
                        "tokens nearest the prompt's end (no check; docs/quality.md)")
    parser.add_argument("--recompute-budget", type=float, metavar="B",
                        default=ENGINE.cache.recompute_budget,
                        help="live mode, repair: compute at most this share of each prompt's "
                        "reused tokens, heads and share together; the heads shrink to fit "
                        "(0: no cap)")
    parser.add_argument("--recompute-check-layer", type=int, metavar="N",
                        default=ENGINE.cache.recompute_check_layer,
                        help="the check forward's layer (deviation) or last layer (signed); "
                        "it costs N layers of a fresh prefill")
    parser.add_argument("--no-sub-windows", action="store_true",
                        help="live mode: reuse whole chunks and regions only, not the 32-token "
                        "sub-windows of a missed chunk (repeats inside otherwise new messages, "
                        "whose rows carry the most context error: on re-ranked documents ~4x "
                        "lower KL for ~44%% fewer PIC tokens; docs/quality.md)")


def write_json(path: str | None, reports: list[dict]) -> None:
    if path:
        payload = reports[0] if len(reports) == 1 else {"logs": reports}
        Path(path).write_text(json.dumps(payload, indent=1), encoding="utf-8")


def model_dir_of(args: argparse.Namespace) -> Path:
    """--model (a directory or a Hub repo id), or the embedded default model."""
    # The model package (and torch with it) is imported only by the commands that run a model.
    from ..model import default_model_dir
    from ..model.hub import resolve_model

    model = getattr(args, "model", None)  # serve leaves it out of --help's defaults
    return resolve_model(model) if model else default_model_dir()


def model_renderer(args: argparse.Namespace) -> ChatRenderer:
    """The model directory's tokenizer and chat template, unless another directory is named."""
    from ..traffic.render import TemplateError

    try:
        return ChatRenderer.from_dir(args.tokenizer or model_dir_of(args))
    except (FileNotFoundError, TemplateError) as err:
        raise ValueError(f"{err} (prompts are rendered with the model directory's "
                         "tokenizer.json and chat template; pass --tokenizer DIR to use "
                         "another)") from err


def repair_cache(args: argparse.Namespace) -> CacheConfig:
    """The default planner config with the knobs of :func:`repair_options`."""
    return dataclasses.replace(ENGINE.cache, recompute_head=args.recompute_head,
                               recompute_share=args.recompute_share,
                               recompute_rule=args.recompute_rule,
                               recompute_budget=args.recompute_budget,
                               recompute_check_layer=args.recompute_check_layer,
                               s1=ENGINE.cache.s1 and not args.no_sub_windows)


def text_pool(renderer: ChatRenderer, sources: list[Path]) -> TextPool:
    texts = [m["content"] for src in sources for r in read_requests(src) for m in r.messages
             if isinstance(m.get("content"), str) and m["role"] in ("user", "tool")]
    return TextPool(texts, renderer)


def write_workload(pattern: str, out: Path, source: Path, pool: TextPool, *, requests: int,
                    header_tokens: int, markers: bool = False, seed: int = 0) -> int:
    bodies = list(read_requests(source, strict=True))
    return write_requests(out, build_workload(pattern, bodies, pool, requests=requests,
                                              header_tokens=header_tokens, markers=markers,
                                              seed=seed))


@contextlib.contextmanager
def built_workloads(args: argparse.Namespace, renderer: ChatRenderer) -> Iterator[list[Path]]:
    """The --workload logs; without any, DEFAULT_WORKLOAD built from the shipped samples with the
    model's tokenizer (header lengths count its tokens) into a temporary file."""
    if args.workload:
        yield [Path(p) for p in args.workload]
        return
    samples = sample_logs()
    requests = args.requests or DEFAULT_REQUESTS
    with tempfile.TemporaryDirectory(prefix="irminsul-") as tmp:
        path = Path(tmp) / f"{DEFAULT_WORKLOAD}.jsonl"
        write_workload(DEFAULT_WORKLOAD, path, samples[0], text_pool(renderer, samples),
                        requests=requests, header_tokens=DEFAULT_HEADER_TOKENS)
        print(f"workload: {DEFAULT_WORKLOAD}, {requests} requests with {DEFAULT_HEADER_TOKENS}-token "
              f"headers, built from the shipped {samples[0].name.split('.')[0]} sample "
              "(--workload LOG to use another)")
        yield [path]
