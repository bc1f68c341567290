"""Content-defined chunking and fingerprints over token ids (paper §4, Appendix B).

The chunker is a Gear rolling hash with a 64-bit state, fed one *gear value* per token:

    state_t = (state_{t-1} << 1) + gear(token_t)   (mod 2**64),   state_{-1} = 0

so state_t = sum_{i<64} gear(token_{t-i}) << i depends only on the last 64 tokens. A chunk may end
after token t when the low ``mask_bits`` bits of state_t are zero (expected spacing 2**mask_bits),
with chunk sizes clamped to [min_size, max_size]. A *reset* at offset r forces a boundary there and
restarts the state from zero, so content after a reset chunks identically wherever it sits.

``gear(id)`` is the SplitMix64 finaliser of the token id (see :func:`gear_values`); ids reach 130k+,
so a 256-entry byte table does not apply.

Vectorisation: the low b bits of state_t only involve the terms i < b (the others are shifted past
bit b), so they equal the low b bits of H_b[t] = sum_{i<b} gear(token_{t-i}) << i, which numpy builds
by doubling, H_{2m}[t] = H_m[t] + (H_m[t-m] << m): ceil(log2 b) vectorised passes in a b-bit integer
type. Only the choice among candidate cuts (the min/max clamp) is sequential; it runs at most twice
per chunk, never per token.
"""

from __future__ import annotations

import hashlib
import threading
from bisect import bisect_left
from collections.abc import Iterable

import numpy as np
import xxhash

GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
# Multiplier of the polynomial window fingerprint (odd, so it is invertible mod 2**64).
_POLY = 0xD6E8FEB86659FD93


_GOLDEN = np.uint64(GOLDEN)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, elementwise on a uint64 array (wrapping arithmetic: numpy does not
    check integer arrays for overflow). In place on one new array: on the short arrays of a
    registered chunk, numpy's per-call cost is most of the work."""
    z = x + _GOLDEN
    z ^= z >> _S30
    z *= _MIX1
    z ^= z >> _S27
    z *= _MIX2
    z ^= z >> _S31
    return z


class _GearTable:
    """gear(id) for every id below a power-of-two bound, grown on demand, one copy per dtype.

    Ids at or above ``LIMIT`` (valid up to 2**32, but no real vocabulary is that large) are hashed
    directly instead: a table indexed by them would take up to 32 GiB.
    """

    LIMIT = 1 << 22  # 4M ids: a 32 MiB uint64 table

    def __init__(self) -> None:
        self._tables: dict[np.dtype, np.ndarray] = {}
        self._size = 0
        # Threads chunk at once (the router's and the server's render workers): growing the
        # tables is one thread's at a time; reading them takes no lock (a dict swapped whole).
        self._lock = threading.Lock()

    def lookup(self, tokens: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """gear(id) of each of ``tokens`` (validated ids: non-negative) as ``dtype``."""
        dtype = np.dtype(dtype)
        table = self._tables.get(dtype)
        if table is not None:
            try:  # an id past the table raises: no pass over the ids to find the largest first
                return table[tokens]
            except IndexError:
                pass
        needed = int(tokens.max()) + 1 if tokens.size else 1
        if needed > self.LIMIT:
            return splitmix64(tokens.astype(np.uint64)).astype(dtype)
        with self._lock:
            tables = self._tables
            if needed > self._size:
                self._size = 1 << max(17, (needed - 1).bit_length())
                tables = {np.dtype(np.uint64): splitmix64(np.arange(self._size,
                                                                    dtype=np.uint64))}
            if dtype not in tables:
                tables = {**tables, dtype: tables[np.dtype(np.uint64)].astype(dtype)}
            self._tables = tables
        return tables[dtype][tokens]


_GEAR = _GearTable()


def as_token_array(tokens: Iterable[int] | np.ndarray) -> np.ndarray:
    """Validate a 1-D array of token ids in [0, 2**32) and return it as a numpy integer array."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise ValueError(f"token ids must be >= 0, got {int(arr.min())} at {int(arr.argmin())}")
    if arr.dtype.itemsize > 4 and int(arr.max()) >= 1 << 32:
        raise ValueError(f"token ids must be < 2**32, got {int(arr.max())} at {int(arr.argmax())}")
    return arr


def gear_values(tokens: np.ndarray) -> np.ndarray:
    """The 64-bit gear value of every token: ``splitmix64(id)``."""
    return _GEAR.lookup(as_token_array(tokens), np.uint64)


def as_offsets(offsets: Iterable[int] | np.ndarray) -> np.ndarray:
    """Offsets (any iterable of ints) as a sorted, duplicate-free int64 array."""
    if not isinstance(offsets, np.ndarray):
        offsets = np.fromiter(offsets, dtype=np.int64)
    offsets = offsets.astype(np.int64, copy=False)
    if offsets.ndim == 1 and (offsets[1:] > offsets[:-1]).all():
        return offsets  # already sorted and distinct, as a prompt's resets come: skip the sort
    return np.unique(offsets)


def _normalise_resets(resets: Iterable[int] | np.ndarray, n: int) -> np.ndarray:
    r = as_offsets(resets)
    if r.size and (r[0] < 0 or r[-1] > n):
        raise ValueError(f"reset offsets must lie in [0, {n}], got {r[0]}..{r[-1]}")
    return r[(r > 0) & (r < n)]


def _low_state_bits(tokens: np.ndarray, bits: int, resets: np.ndarray) -> np.ndarray:
    """Low ``bits`` bits of the Gear state after every token (higher bits of the result are junk)."""
    dtype = np.uint16 if bits <= 16 else np.uint32 if bits <= 32 else np.uint64
    gear = _GEAR.lookup(tokens, dtype)
    h = gear.copy()
    span = 1
    while span < bits:
        h[span:] += h[:-span] << dtype(span)
        span *= 2
    if resets.size:
        # The first bits-1 states after a reset r must not see tokens before it. The state after
        # token r + j is (state after r - 1) << (j + 1) plus the state from zero, so subtracting
        # the first term restarts it (all of them at once, each up to the next reset, which
        # restarts its own). Resets are > 0, and low bits only ever depend on low bits.
        shift = np.arange(1, bits, dtype=dtype)
        pos = resets[:, None] + np.arange(bits - 1)
        live = pos < np.append(resets[1:], tokens.size)[:, None]
        restarted = h[np.minimum(pos, tokens.size - 1)] - (h[resets - 1][:, None] << shift)
        h[pos[live]] = restarted[live]
    return h


def chunk_boundaries(tokens: Iterable[int] | np.ndarray, *, mask_bits: int = 7, min_size: int = 32,
                     max_size: int = 512, resets: Iterable[int] | np.ndarray = ()) -> np.ndarray:
    """Chunk end offsets (int64, strictly increasing, last == len(tokens)) of a token-id array.

    A chunk ends after token t when the low ``mask_bits`` bits of the Gear state are zero and the
    chunk holds at least ``min_size`` tokens, or when it reaches ``max_size`` tokens, or at a reset
    offset, or at the end of the array (the last two may give chunks shorter than ``min_size``).
    """
    arr = as_token_array(tokens)
    n = int(arr.size)
    if not 1 <= mask_bits <= 64:
        raise ValueError(f"mask_bits must be in [1, 64], got {mask_bits}")
    if not 1 <= min_size <= max_size:
        raise ValueError(f"need 1 <= min_size <= max_size, got {min_size}, {max_size}")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    cuts = _normalise_resets(resets, n)
    state = _low_state_bits(arr, mask_bits, cuts)
    return _cut(_candidates(state, mask_bits), cuts.tolist(), n, min_size, max_size)


def chunk_boundaries_sweep(tokens: Iterable[int] | np.ndarray, mask_bits: Iterable[int], *,
                           min_size: int = 32, max_size: int = 512) -> dict[int, np.ndarray]:
    """:func:`chunk_boundaries` (no resets) for each of several ``mask_bits`` at once.

    The low b bits of the Gear state are the same whichever wider state they are read from, so
    one state at the widest mask gives every narrower mask's cut candidates (the chunker's state,
    its most expensive part, is built once instead of once per mask)."""
    arr = as_token_array(tokens)
    widths = sorted(set(mask_bits))
    if not widths or not 1 <= widths[0] <= widths[-1] <= 64:
        raise ValueError(f"mask_bits must be in [1, 64], got {widths}")
    if not 1 <= min_size <= max_size:
        raise ValueError(f"need 1 <= min_size <= max_size, got {min_size}, {max_size}")
    if not arr.size:
        return {k: np.zeros(0, dtype=np.int64) for k in widths}
    state = _low_state_bits(arr, widths[-1], np.zeros(0, dtype=np.int64))
    return {k: _cut(_candidates(state, k), [], int(arr.size), min_size, max_size)
            for k in widths}


def _candidates(state: np.ndarray, mask_bits: int) -> list[int]:
    """Offsets a chunk may end at: just after each token whose low ``mask_bits`` state bits are
    zero."""
    mask = state.dtype.type((1 << mask_bits) - 1)
    return (np.flatnonzero((state & mask) == 0) + 1).tolist()


def _cut(candidates: list[int], cuts: list[int], n: int, min_size: int,
         max_size: int) -> np.ndarray:
    """Chunk ends from the candidates, clamped to [min_size, max_size], forced at every reset
    ``cuts`` (sorted, inside (0, n)) and at ``n``."""
    bounds: list[int] = []
    append = bounds.append
    pos, i, count = 0, 0, len(candidates)
    for seg_end in cuts + [n]:
        while i < count and (end := candidates[i]) <= seg_end:
            if end - pos < min_size:
                # Skip candidates too close to the last cut in one step: candidates are distinct
                # and increasing, so the next usable one is among the next min_size of them.
                i = bisect_left(candidates, pos + min_size, i, min(count, i + min_size))
                continue
            while end - pos > max_size:  # no candidate in time: forced cuts at max_size
                pos += max_size
                append(pos)
            if end - pos >= min_size:
                append(end)
                pos = end
                i += 1
        while seg_end - pos > max_size:
            pos += max_size
            append(pos)
        if pos < seg_end:
            append(seg_end)
            pos = seg_end
    return np.asarray(bounds, dtype=np.int64)


class Fingerprinter:
    """The fingerprint of any span of one token array, on demand: xxHash64 over the span's token
    ids as little-endian uint32, seeded with the namespace."""

    def __init__(self, tokens: Iterable[int] | np.ndarray, seed: int = 0) -> None:
        self._buf = memoryview(np.ascontiguousarray(as_token_array(tokens), dtype="<u4")).cast("B")
        self._seed = seed

    def __call__(self, start: int, end: int) -> int:
        """The fingerprint of tokens[start:end]."""
        return xxhash.xxh64_intdigest(self._buf[4 * start:4 * end], self._seed)


def fingerprints(tokens: Iterable[int] | np.ndarray, boundaries: np.ndarray, *,
                 seed: int = 0) -> np.ndarray:
    """One :class:`Fingerprinter` fingerprint per chunk.

    ``boundaries`` are chunk end offsets as returned by :func:`chunk_boundaries`; the seed carries
    the model and tenant namespace, so equal content in two namespaces never shares a fingerprint.
    """
    fingerprint = Fingerprinter(tokens, seed)
    ends = np.asarray(boundaries, dtype=np.int64).tolist()
    return np.asarray([fingerprint(start, end) for start, end in zip([0] + ends, ends)],
                      dtype=np.uint64)


def window_fingerprints(tokens: Iterable[int] | np.ndarray, width: int, *,
                        seed: int = 0) -> np.ndarray:
    """Fingerprint of every ``width``-token sliding window (``width`` a power of two).

    Element t fingerprints tokens[t : t + width]. A polynomial hash of the gear values,
    sum_i gear(tok[t+i]) * P**(width-1-i) mod 2**64, built by doubling in log2(width) passes, then
    mixed with the seed through SplitMix64. It finds repeated windows at any offset in O(n) numpy
    work; unlike :func:`fingerprints` it is not xxHash, so anything served from a window hit must
    still be verified token by token (the registry does).
    """
    if width < 1 or width & (width - 1):
        raise ValueError(f"window width must be a power of two, got {width}")
    arr = as_token_array(tokens)
    if arr.size < width:
        return np.zeros(0, dtype=np.uint64)
    h = _GEAR.lookup(arr, np.uint64)
    span = 1
    while span < width:
        # h[t] covers tokens[t : t + span]; extend to 2*span by appending the window that follows.
        h = h[:-span] * np.uint64(pow(_POLY, span, 1 << 64)) + h[span:]
        span *= 2
    return splitmix64(h ^ np.uint64(seed & (2**64 - 1)))


def tiled_window_fingerprints(tokens: Iterable[int] | np.ndarray, width: int, *,
                              seed: int = 0) -> np.ndarray:
    """:func:`window_fingerprints` of the whole windows at offsets 0, width, 2·width, … only
    (what the registry indexes of a chunk): the same polynomial, summed per tile instead of
    built for every offset by doubling."""
    if width < 1 or width & (width - 1):
        raise ValueError(f"window width must be a power of two, got {width}")
    arr = as_token_array(tokens)
    whole = arr.size // width
    if not whole:
        return np.zeros(0, dtype=np.uint64)
    gear = _GEAR.lookup(arr[:whole * width], np.uint64).reshape(whole, width)
    h = (gear * _powers(width)).sum(axis=1, dtype=np.uint64)  # mod 2**64, as the doubling's
    h ^= np.uint64(seed & (2**64 - 1))
    return splitmix64(h)


_POWERS: dict[int, np.ndarray] = {}


def _powers(width: int) -> np.ndarray:
    """P**(width-1-i) mod 2**64 for i < width: a window's term weights, first token highest."""
    if width not in _POWERS:
        out, p = [], 1
        for _ in range(width):
            out.append(p)
            p = p * _POLY % (1 << 64)
        _POWERS[width] = np.array(out[::-1], dtype=np.uint64)
    return _POWERS[width]


def namespace_seed(*parts: str) -> int:
    """A 64-bit fingerprint seed for a namespace (model id, tenant salt, ...): BLAKE2b of the
    parts, each length-prefixed (no part can carry a separator into the next). One-way, unlike
    xxh64: whoever learns a tenant's namespace (a store key, a log line) cannot make a salt that
    names it, as an xxh64 preimage would (its last input lane solves in closed form)."""
    digest = hashlib.blake2b(digest_size=8, person=b"irminsul-ns")
    for part in parts:
        data = part.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return int.from_bytes(digest.digest(), "little")


def request_namespace(model_name: str, salt: str | None) -> int:
    """A request's cache namespace: the model, and the tenant's ``cache_salt`` when one is
    given (the seed of every fingerprint; the server and the router compute it alike)."""
    return namespace_seed(model_name) if salt is None else namespace_seed(model_name, salt)
