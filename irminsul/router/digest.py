"""The published index: what a backend tells routers about its cache (``GET /irminsul/index``).

A digest holds two sets of 64-bit hashes and the backend's load:

    prefix   one hash per whole BLOCK_TOKENS-token block of every path in the radix tree,
             chained from the namespace: h_0 = namespace, h_k = xxh64(block k, seed=h_{k-1}),
             published as public(h_k). A request whose first k block hashes are all in the set
             has (almost surely) its first k * BLOCK_TOKENS tokens in the tree: what the exact
             prefix would serve.
    chunks   public(fingerprint) of every registry entry (chunks, regions, runs): the
             fingerprint is xxh64 seeded with the namespace, exactly the planner's
             (irminsul.cache.cdc). A request's chunk or region whose value is in the set is
             content the backend can reuse.

Both are hashes only: a router never sees tokens, and a hash that collides costs a routing
choice, never an output (the engine verifies every hit token by token). ``public`` is one-way
(BLAKE2b): xxh64 is not, so its values published as they are would let whoever reads the index,
salt or no salt, solve a short entry's fingerprint for the namespace seeding it, and extend a
published chain h_k with a guessed next block (a membership test of a salted tenant's content).

Polling is incremental. A digest names the backend process (``generation``, random per start)
and a ``version`` that grows whenever the sets change; a router sends the generation and version
it holds and gets what was added and removed since, or everything (``full``) when the backend
no longer knows that version (restarted, or too far behind). Sets travel as base64 of sorted
little-endian uint64 arrays.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import xxhash

FORMAT = 2  # 2: published values through public()
BLOCK_TOKENS = 64  # tokens per prefix block: the prefix is known to this granularity
_MASK = (1 << 64) - 1


class DigestError(ValueError):
    """A digest that does not parse: the message says which field and why."""


def block_bytes(tokens: np.ndarray) -> bytes:
    """Token ids as the bytes a block hash covers: little-endian uint32, as fingerprints."""
    return np.ascontiguousarray(tokens, dtype="<u4").tobytes()


def public(value: int) -> int:
    """What the index publishes of a chain hash or a fingerprint: a one-way 64-bit digest of it
    (BLAKE2b), from which neither the value nor its namespace seed can be solved for."""
    digest = hashlib.blake2b((value & _MASK).to_bytes(8, "little"), digest_size=8,
                             person=b"irminsul-index")
    return int.from_bytes(digest.digest(), "little")


def prefix_hashes(tokens: np.ndarray, seed: int) -> list[int]:
    """The published hash (:func:`public`) of every whole block of ``tokens``, chained from
    ``seed`` (the namespace): what a request's prefix is matched by."""
    return [public(h) for h in chain_hashes(tokens, seed)]


def chain_hashes(tokens: np.ndarray, seed: int) -> list[int]:
    """The chained hash of every whole block of ``tokens``, the chain starting from ``seed``
    (the namespace, for a prompt's first block; a block's hash, to go on after it). Never
    published as they are (see :func:`public`)."""
    data = block_bytes(tokens)
    size = 4 * BLOCK_TOKENS
    out, h = [], seed & _MASK
    for offset in range(0, len(data) - size + 1, size):
        h = xxhash.xxh64_intdigest(data[offset:offset + size], h)
        out.append(h)
    return out


def encode_set(values: Iterable[int]) -> str:
    """Hashes as base64 of their sorted little-endian uint64 array."""
    array = np.fromiter(values, dtype=np.uint64)
    array.sort()
    return base64.b64encode(array.astype("<u8").tobytes()).decode("ascii")


def decode_set(text: object, where: str) -> set[int]:
    """The hashes :func:`encode_set` wrote; DigestError naming ``where`` otherwise."""
    if not isinstance(text, str):
        raise DigestError(f"{where}: expected a base64 string, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError as err:
        raise DigestError(f"{where}: not base64 ({err})") from err
    if len(raw) % 8:
        raise DigestError(f"{where}: {len(raw)} bytes is not a whole number of uint64 values")
    return set(np.frombuffer(raw, dtype="<u8").tolist())


@dataclass(frozen=True)
class Chunking:
    """How the backend cuts prompts (its CacheConfig's fields a router must cut alike)."""

    mask_bits: int
    min_chunk: int
    max_chunk: int
    carve_out: int
    regions: bool


@dataclass(frozen=True)
class Load:
    """A backend's load when it answered: requests running and waiting, KV pool share in use."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0


@dataclass(frozen=True)
class Digest:
    """One answer of ``/irminsul/index``: the sets' changes since the version asked about (or
    all of them, ``full``), the chunking they were made with, and the load."""

    generation: str
    version: int
    full: bool
    chunking: Chunking
    load: Load
    prefix_added: set[int]
    prefix_removed: set[int]
    chunks_added: set[int]
    chunks_removed: set[int]

    def to_json(self) -> dict:
        c = self.chunking
        return {"format": FORMAT, "generation": self.generation, "version": self.version,
                "full": self.full, "block_tokens": BLOCK_TOKENS,
                "chunking": {"mask_bits": c.mask_bits, "min_chunk": c.min_chunk,
                             "max_chunk": c.max_chunk, "carve_out": c.carve_out,
                             "regions": c.regions},
                "load": {"running": self.load.running, "waiting": self.load.waiting,
                         "kv_usage": self.load.kv_usage},
                "prefix": {"added": encode_set(self.prefix_added),
                           "removed": encode_set(self.prefix_removed)},
                "chunks": {"added": encode_set(self.chunks_added),
                           "removed": encode_set(self.chunks_removed)}}

    @classmethod
    def from_json(cls, body: object) -> Digest:
        """Parse an answer; DigestError names the first field that is wrong."""
        if not isinstance(body, dict):
            raise DigestError("the index must be a JSON object")
        if body.get("format") != FORMAT or body.get("block_tokens") != BLOCK_TOKENS:
            raise DigestError(f"format {body.get('format')!r} with {body.get('block_tokens')!r}-"
                              f"token blocks; this router reads format {FORMAT} with "
                              f"{BLOCK_TOKENS}-token blocks")
        try:
            c, load = body["chunking"], body["load"]
            chunking = Chunking(int(c["mask_bits"]), int(c["min_chunk"]), int(c["max_chunk"]),
                                int(c["carve_out"]), bool(c["regions"]))
            parsed_load = Load(int(load["running"]), int(load["waiting"]),
                               float(load["kv_usage"]))
            # What an engine reports: a share of its pool, and counts. A NaN share would make
            # every score compare false (no backend could be chosen).
            if not 0.0 <= parsed_load.kv_usage <= 1.0:
                raise DigestError(f"load.kv_usage: {parsed_load.kv_usage} is not a share in "
                                  "[0, 1]")
            for name in ("running", "waiting"):
                if getattr(parsed_load, name) < 0:
                    raise DigestError(f"load.{name}: {getattr(parsed_load, name)} is negative")
            generation, version, full = (str(body["generation"]), int(body["version"]),
                                         bool(body["full"]))
            prefix, chunks = body["prefix"], body["chunks"]
            sets = [decode_set(part[key], f"{name}.{key}")
                    for name, part in (("prefix", prefix), ("chunks", chunks))
                    for key in ("added", "removed")]
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, DigestError):
                raise
            raise DigestError(f"malformed index: {err!r}") from err
        return cls(generation, version, full, chunking, parsed_load, *sets)
