"""Plain-Python reference implementations of the chunker and fingerprints, token by token.

Written straight from the definitions in irminsul.cache.cdc's docstring, sharing no code with it.
"""

from __future__ import annotations

import xxhash

M64 = (1 << 64) - 1


def gear(token: int) -> int:
    """SplitMix64 finaliser of a token id, on Python ints."""
    z = (token + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def chunk_boundaries(tokens: list[int], mask_bits: int = 7, min_size: int = 32, max_size: int = 512,
                     resets: tuple[int, ...] = ()) -> list[int]:
    reset_set = set(resets)
    mask = (1 << mask_bits) - 1
    bounds: list[int] = []
    start, state = 0, 0
    for t, tok in enumerate(tokens):
        if t in reset_set:
            if t > start:
                bounds.append(t)
                start = t
            state = 0
        state = ((state << 1) + gear(tok)) & M64
        size = t + 1 - start
        if (size >= min_size and state & mask == 0) or size >= max_size:
            bounds.append(t + 1)
            start = t + 1
    if start < len(tokens):
        bounds.append(len(tokens))
    return bounds


def fingerprints(tokens: list[int], boundaries: list[int], seed: int = 0) -> list[int]:
    out, start = [], 0
    for end in boundaries:
        data = b"".join(t.to_bytes(4, "little") for t in tokens[start:end])
        out.append(xxhash.xxh64_intdigest(data, seed))
        start = end
    return out


def window_fingerprint(window: list[int], seed: int = 0) -> int:
    """Polynomial hash of the gear values (Horner's rule), then SplitMix64 of it xor the seed."""
    h = 0
    for tok in window:
        h = (h * 0xD6E8FEB86659FD93 + gear(tok)) & M64
    return gear((h ^ seed) & M64)
