"""The live-PIC audit: a sampled share of the requests PIC served, recomputed in idle capacity.

The correctness gate (:mod:`irminsul.quality`) vouches for a checkpoint on a probe set before
serving; the audit watches what is actually served. A request whose prompt took rows from the
registry, or whose exact-prefix match ran over rows an earlier turn reused (a derived prefix,
which carries that turn's approximation), is picked with probability ``rate``; its prompt and the
first-token logits it was
served are kept (a few at most: the queue is bounded, a full queue skips), and when the scheduler
has nothing else to do one of them is recomputed from scratch — as a request's prefill is (the
same kernels and attention over the pool, its slots made room for as any prefill's), reusing
nothing and leaving nothing it computed cached — and
KL(full ‖ served) of the first token is recorded. A plain forward would not do as the reference:
on a GPU its bf16 arithmetic differs from the serve path's by 1e-5 to 1e-3 nats with nothing
reused at all (benchmarks/gpu/audit_floor.py), as much as reuse itself costs on most traffic.
Operators see the KL distribution on /metrics (``irminsul:pic_audit_kl``), so drift (new
traffic, a new checkpoint, a regression) shows before users notice.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

# A recomputation is a prefill of the whole prompt in the pool, evicting cached rows where the
# free room is short: longer prompts are not audited.
AUDIT_MAX_TOKENS = 8192
# KL(full ‖ served) of the first token, in nats: the gate's limit is 0.02 (irminsul.config).
KL_BUCKETS = (1e-6, 1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.02, 0.05, 0.1, 0.3, 1.0)


@dataclass
class AuditStats:
    """What the audit has recorded: a histogram of KL values (counts per bucket's upper bound,
    not cumulative; the last is past every bound), their sum and count, and the skips."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(KL_BUCKETS) + 1))
    kl_sum: float = 0.0
    audited: int = 0
    skipped: int = 0  # picked while the queue was full

    def record(self, kl: float) -> None:
        self.counts[int(np.searchsorted(KL_BUCKETS, kl, side="left"))] += 1
        self.kl_sum += kl
        self.audited += 1


class PicAudit:
    """Picks served requests at ``rate`` (seeded), holds at most ``queue`` of them, and
    recomputes one per :meth:`run`."""

    def __init__(self, rate: float, *, queue: int = 4, seed: int = 0) -> None:
        if not 0 <= rate <= 1:
            raise ValueError(f"audit rate must be in [0, 1], got {rate}")
        self.rate = rate
        self._pending: deque[tuple[np.ndarray, torch.Tensor]] = deque()
        self._room = queue
        self._rng = random.Random(seed)
        self.stats = AuditStats()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def consider(self, prompt: np.ndarray, served: torch.Tensor, reused_tokens: int) -> None:
        """A request's prompt and the first-token logits it was served: kept for an audit if
        some of it was served reused rows (``reused_tokens``: PIC hits and derived prefix), the
        prompt is at most AUDIT_MAX_TOKENS long, and the draw picks it."""
        if (reused_tokens <= 0 or self.rate <= 0 or len(prompt) > AUDIT_MAX_TOKENS
                or self._rng.random() >= self.rate):
            return
        if len(self._pending) >= self._room:
            self.stats.skipped += 1
            return
        self._pending.append((np.array(prompt, dtype=np.int64), served.detach().float().clone()))

    def run(self, recompute: Callable[[np.ndarray], torch.Tensor]) -> float | None:
        """Recompute the oldest kept request and record its KL; None when none is kept.
        ``recompute``: a prompt's last logits [vocab] from scratch, reusing nothing
        (:meth:`~irminsul.engine.Engine.recompute_in_pool`, which runs on every rank under
        tensor parallel)."""
        if not self._pending:
            return None
        prompt, served = self._pending.popleft()
        full = recompute(prompt)
        kl = float(kl_per_step(full[None], served.to(full.device)[None])[0])
        self.stats.record(kl)
        return kl


def kl_per_step(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) at each row, in float64 so that float noise does not swamp near-zero values."""
    log_p = torch.log_softmax(p_logits.double(), dim=-1)
    log_q = torch.log_softmax(q_logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)

