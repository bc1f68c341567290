"""Token-level partition-shift requests of an exact prompt length: the GPU suite's TTFT cells.

The patterns of :mod:`irminsul.traffic.workloads`, built straight as token ids of real agent text
(:class:`common.AgentText`) so that every prompt has exactly the cell's length:

    agent_meta  one of AGENTS personas (H tokens) and a per-request line (request id, time) before
                the shared body; the exact prefix stops at the line (or earlier, on a new agent).
    sysvar      the per-request line ~H tokens deep in the shared system prompt.
    rerank      a shared prefix, then TOP_K of DOCS retrieved documents in a fresh order per
                request; the documents fill half the prompt (DOC_TOKENS would be a few percent of
                a 16K prompt, too little to matter).

The per-request line is the workloads' own (request id and timestamp, DeepSeek-tokenized). Each
request carries its chunker resets — every message start of the agent text and every region an
assembler inserts (the body after the header, the variable line, each document), as S2 markers
would mark them at zero tokens — and its novel spans: the tokens no earlier request has seen at
any position, less the prefix the request shares with an earlier one (a request line's leading
tokens, the same in every line, are cached at their positions), the only ones an ideal cache
would prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from common import AgentText

from irminsul.cache.radix import common_prefix
from irminsul.traffic.render import ChatRenderer
from irminsul.traffic.workloads import AGENTS, DOCS, TOP_K, _variable

PATTERNS = ("agent_meta", "sysvar", "rerank")


@dataclass(frozen=True)
class ShiftRequest:
    """A prompt, its chunker resets, and the [start, end) spans no earlier request held."""

    prompt: np.ndarray
    resets: list[int]
    novel: list[tuple[int, int]]


def build_requests(pattern: str, text: AgentText, length: int, count: int, *, header: int = 50,
                   seed: int = 0) -> list[ShiftRequest]:
    """``count`` requests of ``pattern`` at exactly ``length`` tokens (``header``: H of
    agent_meta's persona, sysvar's depth)."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {pattern!r}; choose from {', '.join(PATTERNS)}")
    rng = np.random.default_rng(seed)
    renderer = ChatRenderer.default()
    build = {"agent_meta": _agent_meta, "sysvar": _sysvar, "rerank": _rerank}[pattern]
    seen: set[int] = set()  # what an ideal cache holds: agents or documents already sent
    out: list[ShiftRequest] = []
    for j in range(count):
        line = renderer.encode(_variable(rng, j) + "\n").astype(np.int64) % text.vocab
        if pattern != "rerank" and header + line.size >= length:
            raise ValueError(f"{pattern}: a {header}-token header and its {line.size}-token "
                             f"line leave no room in a {length}-token prompt")
        request = build(text, length, header, line, rng, seen)
        cached = max((common_prefix(request.prompt, r.prompt) for r in out), default=0)
        novel = [(max(s, cached), e) for s, e in request.novel if e > cached]
        out.append(ShiftRequest(request.prompt, request.resets, novel))
    return out


def _with_resets(text: AgentText, parts: list[tuple[np.ndarray, int | None]],
                 novel: list[tuple[int, int]]) -> ShiftRequest:
    """Concatenate (tokens, offset in the agent text or None for inserted text) parts; every
    part starts a region, and the agent text's own message starts inside a part are resets."""
    resets, start = [], 0
    for tokens, source in parts:
        if start:
            resets.append(start)
        if source is not None:
            resets += (text.starts_in(source, source + tokens.size) + start).tolist()
        start += tokens.size
    return ShiftRequest(np.concatenate([t for t, _ in parts]), resets, novel)


def _agent_meta(text: AgentText, length: int, header: int, line: np.ndarray,
                rng: np.random.Generator, seen: set[int]) -> ShiftRequest:
    agent = int(rng.integers(0, AGENTS))
    persona = length + agent * header  # personas come from text after the longest body
    body = length - header - line.size
    novel = [(header, header + line.size)] if agent in seen else [(0, header + line.size)]
    seen.add(agent)
    head = np.concatenate([text.tokens[persona:persona + header], line])
    return _with_resets(text, [(head, None), (text.tokens[:body], 0)], novel)


def _sysvar(text: AgentText, length: int, header: int, line: np.ndarray,
            rng: np.random.Generator, seen: set[int]) -> ShiftRequest:
    tail = length - header - line.size
    parts = [(text.tokens[:header], 0), (line, None),
             (text.tokens[header:header + tail], header)]
    return _with_resets(text, parts, [(header, header + line.size)])


def _rerank(text: AgentText, length: int, header: int, line: np.ndarray,
            rng: np.random.Generator, seen: set[int]) -> ShiftRequest:
    doc = length // (2 * TOP_K)
    prefix = length - TOP_K * doc
    parts, novel = [(text.tokens[:prefix], 0)], []
    for d in rng.permutation(DOCS)[:TOP_K].tolist():
        source = length + d * doc  # the document pool lies after the longest prefix
        if d not in seen:
            start = prefix + doc * (len(parts) - 1)
            novel.append((start, start + doc))
            seen.add(d)
        parts.append((text.tokens[source:source + doc], source))
    return _with_resets(text, parts, novel)
