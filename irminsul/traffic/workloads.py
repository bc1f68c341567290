"""Partition-shift workloads (paper §7.4, Table 3): the five operator failure modes on real agent text.

Each pattern rewrites real requests (bodies) from a source log and takes any extra text it needs
(agent headers, retrieved documents) from a pool of real message text, so every token is agent
text except the few variable fields a real assembler would add (request ids, timestamps):

    agent_meta     a per-agent header of ~H tokens before the shared body, ending in a per-request
                   line (request id, time). Early variation: the exact prefix stops inside the header.
    sysvar         a per-request variable (time, request id) on its own line ~H tokens deep in the
                   system prompt (at its end when H exceeds it; tool schemas follow it).
    compact        tool results older than the two newest are compacted, a little more every turn.
    rerank         retrieved documents appended to the turn, a different top-k order every request.
    tool_variants  the tool schema set changes now and then (one tool dropped).

With ``system_tokens`` every request's system prompt also carries one shared reference block of
that many tokens of pool text (a manual, a knowledge base, long tool documentation), so the
patterns can be replayed at agent-sized contexts (16K and more) from short source sessions.
With ``markers=True`` the assembler wraps the shared regions in S2 boundary markers.
Requests walk the source's calls in order (cycling, with a fresh session name per pass).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta, timezone

import numpy as np

from ..cache.markers import assemble
from .logs import Request
from .render import ChatRenderer, _text

PATTERNS = ("agent_meta", "sysvar", "compact", "rerank", "tool_variants")
AGENTS = 4  # distinct agent personas in agent_meta
DOCS, TOP_K, DOC_TOKENS = 8, 4, 300  # rerank: pool size, documents per request, tokens per document
KEEP_TOOL_RESULTS = 2  # compact: newest tool results left verbatim
TOOL_CHANGE_RATE = 0.2  # tool_variants: chance that a request drops one tool
EPOCH = datetime(2026, 5, 7, 9, 0, tzinfo=timezone.utc)


class TextPool:
    """Real agent text, cut into spans of a given number of tokens."""

    def __init__(self, texts: Sequence[str], renderer: ChatRenderer) -> None:
        self.renderer = renderer
        self.tokens = np.concatenate([renderer.encode(t) for t in texts if t.strip()])

    def span(self, num_tokens: int, rng: np.random.Generator) -> str:
        """~num_tokens tokens of contiguous real text from a random place."""
        if self.tokens.size <= num_tokens:
            raise ValueError(f"text pool holds {self.tokens.size} tokens, need {num_tokens}")
        start = int(rng.integers(0, self.tokens.size - num_tokens))
        return self.renderer.tokenizer.decode(self.tokens[start:start + num_tokens].tolist())


def build_workload(pattern: str, bodies: Sequence[Request], pool: TextPool, *, requests: int = 80,
                   header_tokens: int = 250, markers: bool = False,
                   system_tokens: int = 0, seed: int = 0) -> Iterator[dict]:
    """Yield ``requests`` chat requests (log lines as dicts) instantiating ``pattern``."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown workload pattern {pattern!r}; choose from {', '.join(PATTERNS)}")
    if not bodies:
        raise ValueError("the source log holds no requests")
    rng = np.random.default_rng(seed)
    personas = [pool.span(header_tokens, rng) for _ in range(AGENTS * (pattern == "agent_meta"))]
    docs = [pool.span(DOC_TOKENS, rng) for _ in range(DOCS * (pattern == "rerank"))]
    reference = pool.span(system_tokens, rng) if system_tokens else ""
    sessions: dict[str, int] = {}
    for j in range(requests):
        body = bodies[j % len(bodies)]
        session = f"{pattern}-{body.session}-pass{j // len(bodies)}"
        agent = sessions.setdefault(session, len(sessions)) % AGENTS
        messages = copy.deepcopy(body.messages)
        tools = copy.deepcopy(body.tools)
        stamp = _variable(rng, j)
        if reference:
            system = _system_prompt(messages)
            messages[0]["content"] = f"{system}\n\n{reference}" if system else reference
        if pattern == "agent_meta":
            header, system = f"{personas[agent]}\n\n{stamp}", _system_prompt(messages)
            messages[0]["content"] = (assemble([(header, False), (system, True)]) if markers
                                      else f"{header}\n\n{system}")
        elif pattern == "sysvar":
            messages[0]["content"] = _insert_variable(_system_prompt(messages), stamp,
                                                      header_tokens, pool, markers)
        elif pattern == "compact":
            _compact(messages)
        elif pattern == "rerank":
            order = rng.permutation(DOCS)[:TOP_K]
            regions = [(f"[document {d}]\n{docs[d]}\n\n", markers) for d in order]
            messages.append({"role": "user", "content": "Retrieved documents for this turn:\n\n"
                             + (assemble(regions) if markers else "".join(t for t, _ in regions))})
        elif pattern == "tool_variants" and tools and rng.random() < TOOL_CHANGE_RATE:
            del tools[int(rng.integers(0, len(tools)))]
        yield {"session": session, "call": body.call, "messages": messages, "tools": tools}


def _variable(rng: np.random.Generator, j: int) -> str:
    """The per-request line an assembler adds: a request id and a timestamp."""
    when = EPOCH + timedelta(seconds=37 * j + int(rng.integers(0, 30)))
    return f"request-id: {rng.bytes(8).hex()} time: {when.isoformat()}"


def _system_prompt(messages: list[dict]) -> str:
    """The system prompt's text (of its text parts, when given as content parts), adding an
    empty system message if the request has none."""
    if not messages or messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": ""})
    return _text(messages[0].get("content"))


def _insert_variable(system: str, stamp: str, depth_tokens: int, pool: TextPool,
                     markers: bool) -> str:
    """Put ``stamp`` on its own line about ``depth_tokens`` tokens into the system prompt."""
    tokens = pool.renderer.encode(system)
    approx = len(pool.renderer.tokenizer.decode(tokens[:depth_tokens].tolist()))
    cut = system.find("\n", min(approx, len(system)))
    cut = len(system) if cut < 0 else cut + 1
    head, tail = system[:cut], system[cut:]
    line = f"{stamp}\n"
    if markers:
        return assemble([(head, True), (line, False), (tail, True)])
    return head + line + tail


def _compact(messages: list[dict]) -> None:
    """Compact every tool result but the newest few, as forward-iterating compaction does."""
    tool_turns = [i for i, m in enumerate(messages) if m.get("role") == "tool"]
    for i in tool_turns[:-KEEP_TOOL_RESULTS] if len(tool_turns) > KEEP_TOOL_RESULTS else []:
        text = _text(messages[i].get("content"))
        messages[i]["content"] = f"[compacted tool result, {len(text)} chars] {text[:160]}"
