"""Rotary embedding of the 64-dim RoPE slice: frequencies, layout, scales, and the δ-rotation.

Frequencies are computed once from the config in float64 (plain RoPE, or static YaRN). Rotation
pairs follow the checkpoint: interleaved (GPT-J, pairs (2i, 2i+1)) unless ``rope_interleave`` is
false (half-split, pairs (i, i + R/2)); the cache keeps ``k_r`` in that same layout, so re-rotating a
cached key is a pure rotation of the stored vector by ``delta * inv_freq`` — never scaled by the cos/sin
magnitude again (YaRN's magnitude is already inside the key), angles in float64, rotation in float32,
any sign of delta.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import numpy as np
import torch

from ..device import upload
from .config import MLAConfig, RopeConfig

log = logging.getLogger(__name__)

DELTA_LOW_BITS = 10
DELTA_LOW = 1 << DELTA_LOW_BITS  # fine steps of the δ-rotation tables


class KernelRotary(NamedTuple):
    """A rotary as the δ-rotation kernel takes it (:func:`irminsul.kernels.rotate_kr`'s
    arguments after the pool and the rows, in this order): tensors and integers only, so the
    kernels need nothing from the model."""

    cos: torch.Tensor  # float32 [DELTA_LOW + 2·hi_offset + 1, dim/2]: Rotary.delta_tables
    sin: torch.Tensor  # float32, the same shape
    hi_offset: int  # coarse rows on each side of δ = 0
    low_bits: int  # DELTA_LOW_BITS: δ's low bits index the fine rows
    dim: int  # rope dim: a k_r row's width
    interleaved: bool  # pairs (2i, 2i+1); else half-split (i, i + dim/2)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    """float64 inverse frequencies of the ``dim``-wide rotary (dim/2 values)."""
    base = rope.theta
    extra = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    if rope.kind == "default":
        return extra

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (2 * math.pi * rotations)) / (
            2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: keep the original frequency (extrapolate); 0: divide by factor
    return extra / rope.factor * (1.0 - keep) + extra * keep


def cos_sin_magnitude(rope: RopeConfig) -> float:
    """YaRN's attention factor on cos/sin (applied to q_r and k_r); 1.0 for every real checkpoint."""
    if rope.kind == "default":
        return 1.0
    if rope.attention_factor is not None:  # given: used as it is (transformers' YaRN)
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor)


def softmax_scale(config: MLAConfig) -> float:
    """(qk_nope + qk_rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when set."""
    scale = config.qk_head_dim ** -0.5
    rope = config.rope
    if rope.kind != "default" and rope.mscale_all_dim:
        scale *= _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


class Rotary:
    """Applies RoPE at absolute positions and re-rotates cached keys by a position delta."""

    def __init__(self, config: MLAConfig) -> None:
        self.dim = config.qk_rope_head_dim
        self.interleaved = config.rope_interleave
        self.inv_freq = inv_freq(config.rope, self.dim)  # float64 numpy [dim/2]
        self._inv_freq_t: dict[torch.device, torch.Tensor] = {}  # float64, per device
        self._delta_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._last: tuple[torch.Tensor, tuple[torch.device, float], torch.Tensor] | None = None
        self.magnitude = cos_sin_magnitude(config.rope)
        self.rope = config.rope
        self.max_position = config.max_position_embeddings

    def _cis(self, positions: torch.Tensor, device: torch.device,
             magnitude: float = 1.0) -> torch.Tensor:
        """exp(i · position · inv_freq) · magnitude, complex64 [T, dim/2]; the angles in float64
        on the device itself (no host round trip), rounded once."""
        # Every layer rotates q and k at the same positions tensor: compute it once per forward.
        key = (device, magnitude)
        if self._last is not None and self._last[0] is positions and self._last[1] == key:
            return self._last[2]
        freq = self._inv_freq_t.get(device)
        if freq is None:
            freq = self._inv_freq_t[device] = upload(self.inv_freq, device, np.float64)
        angles = positions.to(device=device, dtype=torch.float64).reshape(-1, 1) * freq
        cis = torch.polar(torch.full_like(angles, magnitude), angles).to(torch.complex64)
        self._last = (positions, key, cis)  # holds positions, so its id is not reused
        return cis

    def _rotate(self, x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
        """Rotate pairs of the last dim of x [T, ..., dim] by per-row phasors cis [T, dim/2]:
        pair (a, b) becomes (a cos − b sin, b cos + a sin), one complex multiply, in float32."""
        half = self.dim // 2
        cis = cis.reshape((cis.shape[0],) + (1,) * (x.dim() - 2) + (half,))
        if self.interleaved:  # pairs (2i, 2i+1) are already (real, imaginary)
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], half, 2))
            return torch.view_as_real(pairs * cis).flatten(-2).to(x.dtype)
        pairs = torch.view_as_complex(
            x.float().reshape(*x.shape[:-1], 2, half).transpose(-1, -2).contiguous())
        return torch.view_as_real(pairs * cis).transpose(-1, -2).flatten(-2).to(x.dtype)

    def phasors(self, positions: torch.Tensor, device: torch.device) -> torch.Tensor:
        """RoPE's rotation at ``positions`` [T] as the fused kernels take it: float32 [T, dim/2,
        2], (cos, sin) of each pair's angle times the cos/sin magnitude (a view of the complex
        phasors :meth:`apply` multiplies by, computed once per positions tensor)."""
        return torch.view_as_real(self._cis(positions, device, self.magnitude))

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE at absolute ``positions`` [T] on x [T, ..., dim], times the cos/sin magnitude."""
        return self._rotate(x, self._cis(positions, x.device, self.magnitude))

    def rotate(self, k_r: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
        """Re-rotate cached keys k_r [T, ..., dim] (or [dim]) by ``delta`` positions (a scalar
        or one per row [T])."""
        squeeze = k_r.dim() == 1
        k = k_r.reshape(1, -1) if squeeze else k_r
        delta = torch.as_tensor(delta, dtype=torch.float64).reshape(-1).expand(k.shape[0])
        out = self._rotate(k, self._cis(delta, k.device))
        return out.reshape(-1) if squeeze else out

    def delta_tables(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [DELTA_LOW + hi rows, dim/2] (float32) for rotating by any δ with
        |δ| ≤ max position in kernels: δ = hi·DELTA_LOW + lo, lo in [0, DELTA_LOW) (row lo) and
        hi = δ >> DELTA_LOW_BITS (row DELTA_LOW + hi + hi_offset); the kernel composes the two
        rotations. Each angle is taken in float64 and rounded once, so a composed rotation is
        within a few float32 ulps of the exact one — unlike δ·inv_freq in float32, whose angle
        error reaches 1e-2 rad at δ ~ 1e5."""
        device = torch.device(device)
        if device not in self._delta_tables:
            hi = self.hi_offset
            steps = np.concatenate([np.arange(DELTA_LOW), np.arange(-hi, hi + 1) * DELTA_LOW])
            angles = steps[:, None].astype(np.float64) * self.inv_freq[None]
            self._delta_tables[device] = (upload(np.cos(angles), device, np.float32),
                                          upload(np.sin(angles), device, np.float32))
        return self._delta_tables[device]

    def kernel_args(self, device: torch.device | str) -> KernelRotary:
        """This rotary as the δ-rotation kernel takes it, its tables on ``device``."""
        cos, sin = self.delta_tables(device)
        return KernelRotary(cos, sin, self.hi_offset, DELTA_LOW_BITS, self.dim, self.interleaved)

    @property
    def hi_offset(self) -> int:
        """Rows of the coarse table on each side of δ = 0 (covers ±max position)."""
        return (self.max_position >> DELTA_LOW_BITS) + 1

    def describe(self) -> str:
        r = self.rope
        scaling = ("none" if r.kind == "default" else
                   f"yarn(factor={r.factor:g}, original_max={r.original_max_position}, "
                   f"beta_fast={r.beta_fast:g}, beta_slow={r.beta_slow:g}, mscale={r.mscale}, "
                   f"mscale_all_dim={r.mscale_all_dim})")
        layout = "interleaved (2i, 2i+1)" if self.interleaved else "half-split (i, i+R/2)"
        return (f"rotary: dim={self.dim} theta={r.theta:g} scaling={scaling} layout={layout} "
                f"magnitude={self.magnitude:.6g}")


def audit_rotary(rotary: Rotary, config: MLAConfig) -> None:
    """Check the rotary against a from-first-principles computation and log what it uses.

    Recomputes theta^(-2i/d) and, for YaRN, the ramp element by element in plain Python, and checks
    that a rotation by p then by delta equals one by p + delta on a probe vector. Raises on mismatch.
    """
    r, dim = config.rope, rotary.dim
    expected = []
    for i in range(dim // 2):
        base = r.theta ** (-2.0 * i / dim)
        if r.kind == "yarn":
            def cdim(rot: float) -> float:
                return dim * math.log(r.original_max_position / (2 * math.pi * rot)) / (
                    2 * math.log(r.theta))
            lo, hi = max(math.floor(cdim(r.beta_fast)), 0), min(math.ceil(cdim(r.beta_slow)), dim - 1)
            hi = hi + 0.001 if lo == hi else hi
            ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
            base = base / r.factor * ramp + base * (1.0 - ramp)
        expected.append(base)
    err = float(np.max(np.abs(np.asarray(expected) - rotary.inv_freq) / np.asarray(expected)))
    if err > 1e-12:
        raise RuntimeError(f"rotary audit failed: inv_freq deviates from first principles by {err:.3g}")
    probe = torch.linspace(-1.0, 1.0, dim, dtype=torch.float32)
    once = rotary.rotate(probe, 1234 + 5678)
    twice = rotary.rotate(rotary.rotate(probe, 1234), 5678)
    if not torch.allclose(once, twice, atol=1e-5):
        raise RuntimeError("rotary audit failed: rotations do not compose")
    log.info("%s softmax_scale=%.9g (audited: inv_freq rel err %.1e)", rotary.describe(),
             softmax_scale(config), err)
