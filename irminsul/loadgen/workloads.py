"""The logs ``bench serve`` replays: a named workload built from the shipped samples, or a log.

    agent_meta   (default) the tau-bench airline sample's sessions behind a per-agent header
                 that ends in a per-request line: the exact prefix stops inside the header on
                 every call, the rest is content seen before at a shifted position
    rerank       the same sessions with retrieved documents re-ordered on every turn
    sysvar, compact, tool_variants
                 the other partition-shift patterns (``irminsul workload``)
    append_only  the mini-swe-agent sample as logged: each call extends the last, so the exact
                 prefix serves all that was seen before and PIC has nothing to add

Anything else names a JSON Lines log (plain, .gz or .xz). Patterns are built with the model's
tokenizer (header and document lengths count its tokens) from the first ``sessions`` sessions of
the source only, so a small run stays quick to build; asked for more sessions than the source
holds, they replay its sessions again as new ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..traffic.logs import Request, read_requests, sample_logs
from ..traffic.render import ChatRenderer
from ..traffic.workloads import PATTERNS, TextPool, build_workload
from .sessions import group_sessions

APPEND_ONLY = "append_only"
NAMES = (*PATTERNS, APPEND_ONLY)
HEADER_TOKENS = 250  # agent_meta header / sysvar depth, as irminsul bench's default workload


def text_pool(renderer: ChatRenderer, sources: Iterable[Path]) -> TextPool:
    """The samples' user and tool text, where patterns take headers and documents from."""
    texts = [m["content"] for src in sources for r in read_requests(src) for m in r.messages
             if isinstance(m.get("content"), str) and m["role"] in ("user", "tool")]
    return TextPool(texts, renderer)


def load_workload(name: str, renderer: ChatRenderer, *, sessions: int | None = None,
                  system_tokens: int = 0, seed: int = 0) -> list[Request]:
    """The requests of a named workload (NAMES) or of the log at path ``name``; a pattern's
    requests with a shared reference block of ``system_tokens`` tokens in their system prompt
    (:func:`~irminsul.traffic.workloads.build_workload`)."""
    samples = sample_logs()  # tau-bench airline, mini-swe-agent
    if system_tokens and name not in PATTERNS:
        raise ValueError(f"{name}: a reference block is added to the built patterns only "
                         f"({', '.join(PATTERNS)})")
    if name == APPEND_ONLY:
        return list(read_requests(samples[1], strict=True))
    if name not in PATTERNS:
        if not Path(name).is_file():
            raise FileNotFoundError(f"{name}: no such log, nor a workload name "
                                    f"({', '.join(NAMES)})")
        return list(read_requests(name))
    groups = group_sessions(read_requests(samples[0], strict=True))
    bodies = [r for group in groups[:sessions] for r in group]
    # More sessions than the sample holds: further passes over it, each session under a new
    # name (and, in agent_meta, the next persona), with new per-request lines.
    passes = -(-sessions // len(groups)) if sessions else 1
    built = build_workload(name, bodies, text_pool(renderer, samples),
                           requests=len(bodies) * passes,
                           header_tokens=HEADER_TOKENS, system_tokens=system_tokens, seed=seed)
    return [Request(body["session"], body["call"], body["messages"], body["tools"],
                    source=f"{name}:{i + 1}") for i, body in enumerate(built)]
