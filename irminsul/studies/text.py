"""Real agent text for the studies, as token streams of the model's own tokenizer.

Two kinds of stream come from the shipped samples (irminsul/data/samples) or any logs:

* *contexts*: whole rendered prompts (each session's longest request, chat template applied, so
  each begins with the BOS token every prompt begins with); a study takes their first p tokens as
  the text a block or chunk is placed after.
* *pieces*: distinct rendered messages (each once, however often the logs re-send it) of the
  sessions not used as contexts, back to back, cut into consecutive pieces of a given length: the
  content that is placed, moved and reused. Keeping the context sessions' messages out means no
  piece's text also stands in the context before it (the tau-bench policy, say, is in every
  tau-bench prompt).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..traffic.logs import read_requests, sample_logs
from ..traffic.render import ChatRenderer


@dataclass(frozen=True)
class AgentText:
    """Context prompts and a piece pool of real agent text (token ids of one tokenizer)."""

    contexts: list[np.ndarray]  # int64, rendered prompts, each starting with BOS
    pool: np.ndarray  # int64, distinct messages of the other sessions back to back
    sources: list[str]  # the logs read

    @classmethod
    def from_logs(cls, renderer: ChatRenderer, *, contexts: int,
                  logs: Sequence[str | os.PathLike] | None = None) -> AgentText:
        """``contexts`` sessions' longest prompts as contexts (taken from the logs in turn, so
        both shipped samples contribute) and the other sessions' distinct messages as the pool.
        Default logs: the shipped samples."""
        paths = [str(p) for p in (logs if logs is not None else sample_logs())]
        per_log = []
        for path in paths:
            longest: dict[str, object] = {}
            for request in read_requests(path):
                # Agent logs re-send the history, so a session's last call is its longest.
                longest[request.session] = request
            per_log.append([renderer.render(r.messages, r.tools) for r in longest.values()])
        chosen, rest = [], []
        for i in range(max(len(rendered) for rendered in per_log)):
            for rendered in per_log:
                if i < len(rendered):
                    (chosen if len(chosen) < contexts else rest).append(rendered[i])
        if len(chosen) < contexts:
            raise ValueError(f"the logs hold {len(chosen)} sessions; {contexts} contexts asked for")
        taken = {r.tokens[s:e].tobytes() for r in chosen for s, e in r.spans.tolist()}
        seen, parts = set(taken), []
        for rendered in rest:
            for start, end in rendered.spans.tolist():
                piece = rendered.tokens[start:end]
                if piece.tobytes() not in seen:
                    seen.add(piece.tobytes())
                    parts.append(piece)
        pool = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        return cls([r.tokens.astype(np.int64) for r in chosen], pool, paths)

    def context(self, index: int, length: int) -> np.ndarray:
        """The first ``length`` tokens of context ``index`` (modulo the number of contexts)."""
        tokens = self.contexts[index % len(self.contexts)]
        if tokens.size < length:
            raise ValueError(f"context {index % len(self.contexts)} holds {tokens.size} tokens; "
                             f"{length} needed")
        return tokens[:length]

    def pieces(self, count: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` distinct pieces [count, length] of the pool, chosen at random among its
        consecutive non-overlapping ``length``-token pieces."""
        available = self.pool.size // length
        if count > available:
            raise ValueError(f"the text pool holds {available} pieces of {length} tokens; "
                             f"{count} asked for (use fewer or shorter ones)")
        chosen = rng.choice(available, size=count, replace=False)
        return self.pool[:available * length].reshape(available, length)[chosen]
