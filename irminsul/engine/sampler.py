"""How a request picks its next token from the logits."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# Below this temperature sampling is greedy: logits / T would overflow to inf (vLLM's threshold).
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # signed or unsigned 64 bits, taken modulo 2**64


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens: greedy at temperature 0 (or below :data:`GREEDY_BELOW`), else
    softmax(logits / T) cut by top-k, then top-p."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class NonFiniteLogits(ValueError):
    """A request's logits hold a NaN or a +inf, or nothing above -inf: no token can be picked
    (a numerical fault of the model's on that request; the scheduler fails it alone)."""

    @classmethod
    def after(cls, generated: int) -> NonFiniteLogits:
        """The error for a request that had generated ``generated`` tokens."""
        return cls(f"the model's logits are not finite (NaN or infinite) after {generated} "
                   "generated tokens; cannot pick the next")


def greedy_token(logits: torch.Tensor, generated: int | None = None) -> int:
    """The first index of the maximum of logits [vocab]. Raises :class:`NonFiniteLogits` where
    that maximum is not a finite number (a NaN's or a +inf's index, or 0 of a row all -inf),
    said after ``generated`` tokens where the caller knows how many."""
    token = int(logits.argmax())
    if not math.isfinite(float(logits[token])):
        raise (NonFiniteLogits("the model's logits are not finite; cannot pick a token")
               if generated is None else NonFiniteLogits.after(generated))
    return token


def greedy_tokens(rows: list[torch.Tensor]) -> torch.Tensor:
    """Greedy sampling of a batch, int64 [2, B] on the rows' device, nothing read back: each
    logits row's argmax (first index of the maximum), then 1 where the row's maximum is finite,
    0 where the row has no token to pick (:class:`NonFiniteLogits`; its argmax is a NaN's or a
    +inf's index, or 0, still a valid id to feed a step launched before the read). One tensor,
    so one read back gives both. On CUDA two Triton launches over chunks of the vocabulary
    (:mod:`irminsul.kernels.argmax`, the flag from the second): torch's one reduction kernel
    took ~23 µs of an H200 decode step at batch 1 to 8."""
    stacked = torch.stack(rows)
    if stacked.is_cuda:
        from ..kernels.argmax import argmax_rows  # triton: shipped with CUDA builds of torch

        return argmax_rows(stacked, finite=True)
    ids = stacked.argmax(-1)
    # The maximum is NaN where there is one, +inf where there is one, -inf where all are.
    finite = stacked.gather(-1, ids[:, None])[:, 0].isfinite()
    return torch.stack([ids, finite.to(torch.int64)])


def request_generator(seed: int | None) -> np.random.Generator:
    """A request's random draws: from all 64 bits of its seed, else from the OS's entropy.
    (torch's CPU generator seeds its Mersenne Twister with the seed's low 32 bits only, so
    seeds that differ above them drew the same tokens.)"""
    return np.random.default_rng(None if seed is None else seed % 2**64)


def sample(logits: torch.Tensor, params: SamplingParams, generator: np.random.Generator) -> int:
    """One token id from logits [vocab]. Raises :class:`NonFiniteLogits` when the logits give
    no token to pick (the caller fails that request alone)."""
    if params.greedy:
        return greedy_token(logits)
    logits = logits.float()
    # Subtracting the maximum first keeps logits / T finite for any T >= GREEDY_BELOW.
    logits = (logits - logits.max()) / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays, also
        # when top_p rounds to 0 in float32.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop[0] = False
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if not bool(torch.isfinite(probs).all()):
        raise NonFiniteLogits("the model's logits are not finite; cannot sample")
    # Inverse CDF in float64: normalised, the cumulative mass reaches exactly 1.0 at the last
    # token with any, above every draw in [0, 1), so a token cut to 0 is never drawn.
    cdf = probs.cpu().double().cumsum(-1)
    cdf = cdf / cdf[-1]
    draw = torch.tensor([generator.random()], dtype=torch.float64)
    return int(torch.searchsorted(cdf, draw, right=True))
