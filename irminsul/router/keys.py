"""A request as the router matches it against backends' indexes: its prefix block hashes, and
its regions and chunks with their fingerprints, cut exactly as a backend's planner cuts them
(the engine's own chunker and fingerprints, :mod:`irminsul.cache.cdc`).

The planner chunks a prompt's tail from its anchor, the last reset at or before the exact
prefix's end; every reset restarts the chunker and forces a boundary, so cutting the whole
prompt once from its start gives the same chunks past any anchor that is a reset (every chat
prompt's is: each message start is one). A completion prompt without markers has no resets,
and there the planner's cut depends on where the backend's prefix ends; this cut is then an
estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from ..cache.cdc import Fingerprinter, as_offsets, chunk_boundaries
from .digest import Chunking, block_bytes, prefix_hashes, public


@dataclass(frozen=True)
class Piece:
    """Tokens [start, end) of the prompt and their fingerprint in the request's namespace, as
    an index publishes it (:func:`~.digest.public`)."""

    start: int
    end: int
    fingerprint: int


@dataclass(frozen=True)
class Region:
    """The tokens between two resets, and the chunks the planner would cut them into."""

    whole: Piece
    chunks: tuple[Piece, ...]


@dataclass(frozen=True)
class ContentKeys:
    """A prompt's regions and chunks under one chunking."""

    chunking: Chunking
    regions: tuple[Region, ...]


@dataclass(frozen=True)
class RequestKeys:
    """What the router matches a request by: its size, its prefix block hashes, a hash of the
    whole prompt (tie-breaking), and its content keys per chunking the backends use."""

    size: int
    prefix: tuple[int, ...]
    prompt_hash: int
    content: dict[Chunking, ContentKeys]


def content_keys(tokens: np.ndarray, resets: np.ndarray, namespace: int,
                 chunking: Chunking) -> ContentKeys:
    """The prompt's regions (between consecutive resets) and their chunks, fingerprinted."""
    n = int(tokens.size)
    bounds = chunk_boundaries(tokens, mask_bits=chunking.mask_bits, min_size=chunking.min_chunk,
                              max_size=chunking.max_chunk, resets=resets).tolist()
    cuts = [r for r in as_offsets(resets).tolist() if 0 < r < n] + [n]
    fingerprinter = Fingerprinter(tokens, namespace)

    def fingerprint(start: int, end: int) -> int:
        return public(fingerprinter(start, end))

    regions, first, i = [], 0, 0
    for end in cuts:
        chunks, start = [], first
        while i < len(bounds) and bounds[i] <= end:
            chunks.append(Piece(start, bounds[i], fingerprint(start, bounds[i])))
            start, i = bounds[i], i + 1
        regions.append(Region(Piece(first, end, fingerprint(first, end)), tuple(chunks)))
        first = end
    return ContentKeys(chunking, tuple(regions))


def request_keys(tokens: np.ndarray, resets: np.ndarray, namespace: int,
                 chunkings: set[Chunking]) -> RequestKeys:
    """The keys of a rendered request (``tokens`` and the chunker's ``resets``) in
    ``namespace``, its content cut under each of ``chunkings``."""
    tokens = np.asarray(tokens)
    resets = as_offsets(resets)
    return RequestKeys(int(tokens.size), tuple(prefix_hashes(tokens, namespace)),
                       xxhash.xxh64_intdigest(block_bytes(tokens), namespace),
                       {c: content_keys(tokens, resets, namespace, c) for c in chunkings})
