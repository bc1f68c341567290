"""One rendered request, as every analysis pass sees it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Prompt:
    """A request's prompt tokens with the chunker resets its assembler knows about."""

    session: str
    tokens: np.ndarray  # int32 [n]
    message_starts: np.ndarray  # int64: where each chat message begins
    markers: np.ndarray  # int64: S2 marker edges found in the tokens (empty when none)

    @property
    def size(self) -> int:
        return int(self.tokens.size)
