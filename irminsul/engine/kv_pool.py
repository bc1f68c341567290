"""The split, token-granular latent KV pool (the paper's Appendix C).

Every layer's cache row ``[c_KV | k_r]`` is stored in two places with two slot spaces:

    ckv  [layers, slots, kv_lora_rank]   position-free; one slot is shared by every request, radix
                                         node and registry entry holding that content
    kr   [layers, slots, rope_dim]       position-carrying; a request reusing a chunk at a new
                                         position gets its own slots holding k_r rotated by δ

A token's place in the pool is a pair (ckv slot, kr slot), packed into one int64 *handle* — the
opaque per-token value the radix tree and registry store. Slots are reference-counted; a slot
is free exactly when nothing references it, which :meth:`KVPool.check` verifies.
"""

from __future__ import annotations

import numpy as np
import torch

HANDLE_LOW = np.int64((1 << 32) - 1)  # a handle's low 32 bits: its k_r slot


def pack(ckv: np.ndarray, kr: np.ndarray) -> np.ndarray:
    """Handles from (ckv slot, kr slot) pairs."""
    return (np.asarray(ckv, dtype=np.int64) << 32) | np.asarray(kr, dtype=np.int64)


def unpack(handles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ckv slots, kr slots) of handles."""
    handles = np.asarray(handles, dtype=np.int64)
    return handles >> 32, handles & HANDLE_LOW


def slots_for_memory(layers: int, rank: int, rope: int, dtype: torch.dtype, budget: int,
                     kr_slots: int | None = None) -> int:
    """c_KV slots a pool can have in ``budget`` bytes: each with a k_r slot beside it, or,
    given ``kr_slots``, those k_r rows set aside first."""
    element = torch.empty(0, dtype=dtype).element_size()
    if kr_slots is not None:
        budget -= kr_slots * layers * rope * element
        return max(0, budget // (layers * rank * element))
    return max(0, budget // (layers * (rank + rope) * element))


def free_device_memory(device: torch.device | str) -> int:
    """Bytes a new allocation can take on a CUDA device: free memory, plus what torch's caching
    allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class PoolExhausted(RuntimeError):
    """Not enough free slots; the caller should evict or wait."""


class _Slots:
    """A free stack with reference counts; every operation vectorised (a 32K-token prompt's
    slots are allocated, retained and released per request). The last ``reserved`` slots are
    held for good (one reference each) and never handed out."""

    def __init__(self, size: int, name: str, reserved: int = 0) -> None:
        self.name = name
        self.refs = np.zeros(size + reserved, dtype=np.int32)
        self.refs[size:] = 1
        self._stack = np.arange(size - 1, -1, -1, dtype=np.int64)  # top: low slots first
        self._top = size
        self._mark = np.zeros(size + reserved, dtype=np.int64)  # scratch of _rounds

    @property
    def free(self) -> int:
        return self._top

    def free_slots(self) -> np.ndarray:
        """The slots on the free stack."""
        return self._stack[:self._top]

    def alloc(self, n: int) -> np.ndarray:
        if n > self._top:
            raise PoolExhausted(f"{self.name}: need {n} slots, {self._top} free")
        slots = self._stack[self._top - n:self._top][::-1].copy()
        self._top -= n
        self.refs[slots] = 1
        return slots

    def _rounds(self, slots: np.ndarray) -> list[np.ndarray]:
        """The slots as rounds of distinct slots: round k holds every slot occurring more than
        k times, once (round 0: the distinct slots). Each round writes the occurrences' indices
        to a scratch array; the one write that survives per slot is that slot's occurrence in
        the round. Mostly one round (a sequence's k_r slots, a chunk's), two or three where
        indexes share c_KV slots: linear, where np.unique sorts and a bincount spans the pool."""
        rounds = []
        while slots.size:
            order = np.arange(slots.size)
            self._mark[slots] = order
            won = self._mark[slots] == order
            rounds.append(slots[won])
            slots = slots[~won]
        return rounds

    def retain(self, slots: np.ndarray) -> None:
        for distinct in self._rounds(slots):
            self.refs[distinct] += 1

    def releasable(self, slots: np.ndarray) -> list[np.ndarray]:
        """The rounds of a release, checked against the counts before anything changes: a
        slot in round k occurs k + 1 times at least."""
        rounds = self._rounds(slots)
        for k, distinct in enumerate(rounds):
            if (self.refs[distinct] <= k).any():
                raise RuntimeError(f"{self.name}: a slot was released more often than retained")
        return rounds

    def release(self, rounds: list[np.ndarray]) -> None:
        """Drop the references of a release's rounds (from :meth:`releasable`)."""
        for distinct in rounds:
            self.refs[distinct] -= 1
        if rounds:
            freed = rounds[0][self.refs[rounds[0]] == 0]
            self._stack[self._top:self._top + freed.size] = freed
            self._top += freed.size


class KVPool:
    """Latent KV rows for every layer: ``num_slots`` c_KV slots and ``num_kr_slots`` k_r slots
    (default: as many), plus ``reserved`` tokens' rows outside them (:attr:`reserved`: held by
    the pool itself). A k_r row is 1/9 of a c_KV row's bytes at DeepSeek's shapes, and sessions
    reusing shifted content share c_KV but each hold their own k_r: a pool with more k_r slots
    than c_KV slots holds more such sessions in the same memory."""

    def __init__(self, num_layers: int, num_slots: int, kv_lora_rank: int, rope_dim: int, *,
                 num_kr_slots: int | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", reserved: int = 0) -> None:
        num_kr_slots = num_slots if num_kr_slots is None else num_kr_slots
        self.num_slots, self.num_kr_slots = num_slots, num_kr_slots
        if num_slots < 1 or num_kr_slots < 1:
            raise ValueError(f"a KV pool needs slots in both spaces, got {num_slots} c_KV and "
                             f"{num_kr_slots} k_r")
        self.ckv = torch.zeros(num_layers, num_slots + reserved, kv_lora_rank, dtype=dtype,
                               device=device)
        self.kr = torch.zeros(num_layers, num_kr_slots + reserved, rope_dim, dtype=dtype,
                              device=device)
        self.ckv_slots = _Slots(num_slots, "c_KV pool", reserved)
        self.kr_slots = _Slots(num_kr_slots, "k_r pool", reserved)
        self.reserved = pack(np.arange(num_slots, num_slots + reserved),
                             np.arange(num_kr_slots, num_kr_slots + reserved))

    @property
    def capacity(self) -> int:
        """Tokens the pool holds when empty, each computed fresh (the reserved ones not
        counted): the smaller slot space."""
        return int(min(self.ckv_slots.refs.size, self.kr_slots.refs.size) - self.reserved.size)

    @property
    def free(self) -> int:
        """Tokens that can be allocated fresh (both slot spaces)."""
        return min(self.ckv_slots.free, self.kr_slots.free)

    def alloc(self, n: int) -> np.ndarray:
        """Handles of ``n`` fresh tokens (a new c_KV and a new k_r slot each, one reference)."""
        if n > self.free:
            raise PoolExhausted(f"need {n} token slots, {self.free} free")
        return pack(self.ckv_slots.alloc(n), self.kr_slots.alloc(n))

    def alloc_kr(self, ckv: np.ndarray, *, retain: bool = True) -> np.ndarray:
        """Handles sharing existing c_KV slots with fresh k_r slots. ``retain``: take one more
        reference to each c_KV slot now; False: the caller takes it later (:meth:`retain_slots`),
        while something else is sure to hold those slots."""
        kr = self.kr_slots.alloc(len(ckv))
        if retain:
            self.ckv_slots.retain(np.asarray(ckv, dtype=np.int64))
        return pack(ckv, kr)

    def retain(self, handles: np.ndarray) -> None:
        self.retain_slots(*unpack(handles))

    def retain_slots(self, ckv: np.ndarray, kr: np.ndarray) -> None:
        """One more reference to each c_KV slot in ``ckv`` and each k_r slot in ``kr``."""
        self.ckv_slots.retain(ckv)
        self.kr_slots.retain(kr)

    def release(self, handles: np.ndarray) -> None:
        ckv, kr = unpack(handles)
        # Check both slot spaces before touching either: a bad release changes nothing.
        ckv_release, kr_release = self.ckv_slots.releasable(ckv), self.kr_slots.releasable(kr)
        self.ckv_slots.release(ckv_release)
        self.kr_slots.release(kr_release)

    def rows(self, handles: np.ndarray) -> list[torch.Tensor]:
        """Per-layer latent rows [n, L+R] of tokens, gathered from both stores."""
        ckv, kr = (torch.from_numpy(s).to(self.ckv.device) for s in unpack(handles))
        return [torch.cat([self.ckv[layer, ckv], self.kr[layer, kr]], dim=-1)
                for layer in range(self.ckv.shape[0])]

    def check(self, references: list[np.ndarray], *,
              uncounted: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])) -> None:
        """Raise unless every slot's count equals its references and free means unreferenced.
        ``uncounted``: (c_KV, k_r) slot arrays among the references whose counts are yet to be
        taken."""
        for space, slots in ((self.ckv_slots, 0), (self.kr_slots, 1)):
            expected = np.zeros_like(space.refs)
            for handles in references:  # np.add.at: slow, but independent of _rounds
                np.add.at(expected, unpack(handles)[slots], 1)
            for owed in uncounted[slots]:
                np.add.at(expected, owed, -1)
            if not np.array_equal(expected, space.refs):
                bad = np.flatnonzero(expected != space.refs)[:5].tolist()
                raise AssertionError(f"{space.name}: reference counts off at slots {bad}")
            free = np.zeros(space.refs.size, dtype=np.int32)
            np.add.at(free, space.free_slots(), 1)
            if not np.array_equal(free, space.refs == 0):
                raise AssertionError(f"{space.name}: free list disagrees with reference counts")
