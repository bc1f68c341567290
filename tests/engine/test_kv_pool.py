"""The split, reference-counted KV pool, checked against naive models.

Slot accounting is compared with a list of the handle arrays that hold a reference (what the
engine's indexes and sequences would hold), from which a ``Counter`` per slot space gives the
expected counts; row storage is compared with the tensors written.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from irminsul.engine.kv_pool import KVPool, PoolExhausted, pack, unpack

LAYERS, RANK, ROPE = 3, 8, 4


def _pool(num_slots: int, num_kr_slots: int | None = None) -> KVPool:
    return KVPool(LAYERS, num_slots, RANK, ROPE, num_kr_slots=num_kr_slots)


def _counts(references: list[np.ndarray]) -> tuple[Counter, Counter]:
    """Naive per-slot reference counts (c_KV, k_r) of every handle array held."""
    ckv, kr = Counter(), Counter()
    for handles in references:
        c, k = unpack(handles)
        ckv.update(c.tolist())
        kr.update(k.tolist())
    return ckv, kr


# -- pack / unpack ---------------------------------------------------------------------------------

@given(st.lists(st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 2**32 - 1)), max_size=50))
def test_pack_unpack_round_trip(pairs: list[tuple[int, int]]) -> None:
    """unpack(pack(c, k)) == (c, k) for any c_KV slot < 2**31 and k_r slot < 2**32; handles of
    distinct pairs are distinct and non-negative."""
    ckv = np.asarray([c for c, _ in pairs], dtype=np.int64)
    kr = np.asarray([k for _, k in pairs], dtype=np.int64)
    handles = pack(ckv, kr)
    assert handles.dtype == np.int64 and handles.shape == ckv.shape
    assert (handles >= 0).all()
    c2, k2 = unpack(handles)
    np.testing.assert_array_equal(c2, ckv)
    np.testing.assert_array_equal(k2, kr)
    assert len(set(handles.tolist())) == len(set(pairs))


def test_pack_is_the_documented_bit_layout() -> None:
    """A handle is (ckv << 32) | kr: checked on hand-computed values."""
    assert pack(np.array([0]), np.array([0])).tolist() == [0]
    assert pack(np.array([1]), np.array([2])).tolist() == [2**32 + 2]
    assert pack(np.array([5]), np.array([2**32 - 1])).tolist() == [5 * 2**32 + 2**32 - 1]
    c, k = unpack(np.array([7 * 2**32 + 9]))
    assert (c.tolist(), k.tolist()) == ([7], [9])


# -- reference counting against a naive model --------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(st.integers(1, 12), st.integers(1, 24), st.data())
def test_refcounts_match_naive_counter_model(num_slots: int, num_kr_slots: int, data) -> None:
    """Under random alloc / alloc_kr / retain / release sequences, with slot spaces of any two
    sizes: every slot's count equals the number of held references to it (pool.check against
    the naive list), ``free`` and the k_r space's free count are the unreferenced slots, a
    slot is handed out again only once its count reached 0, and a failing alloc changes
    nothing."""
    pool = _pool(num_slots, num_kr_slots)
    assert pool.capacity == min(num_slots, num_kr_slots)
    held: list[np.ndarray] = []  # the naive model: every handle array holding one reference each
    for _ in range(data.draw(st.integers(1, 40), label="ops")):
        ckv_counts, kr_counts = _counts(held)
        free_ckv = num_slots - sum(1 for v in ckv_counts.values() if v > 0)
        free_kr = num_kr_slots - sum(1 for v in kr_counts.values() if v > 0)
        assert pool.free == min(free_ckv, free_kr) and pool.kr_slots.free == free_kr
        op = data.draw(st.sampled_from(["alloc", "alloc_kr", "retain", "release"]), label="op")
        if op == "alloc":
            n = data.draw(st.integers(0, max(num_slots, num_kr_slots) + 1), label="n")
            if n > min(free_ckv, free_kr):
                with pytest.raises(PoolExhausted):
                    pool.alloc(n)
            else:
                handles = pool.alloc(n)
                c, k = unpack(handles)
                assert len(set(c.tolist())) == n and len(set(k.tolist())) == n
                # reused only after the count reached 0
                assert all(ckv_counts[s] == 0 for s in c.tolist())
                assert all(kr_counts[s] == 0 for s in k.tolist())
                held.append(handles)
        elif op == "alloc_kr" and held:
            source = data.draw(st.sampled_from(held), label="source")
            if source.size == 0:
                continue
            pick = data.draw(st.lists(st.integers(0, source.size - 1), min_size=1, max_size=4))
            ckv = unpack(source[pick])[0]
            if len(pick) > free_kr:
                with pytest.raises(PoolExhausted):
                    pool.alloc_kr(ckv)
            else:
                handles = pool.alloc_kr(ckv)
                c, k = unpack(handles)
                np.testing.assert_array_equal(c, ckv)  # the c_KV slots are shared
                assert len(set(k.tolist())) == len(pick)
                assert all(kr_counts[s] == 0 for s in k.tolist())  # fresh k_r slots
                held.append(handles)
        elif op == "retain" and held:
            source = data.draw(st.sampled_from(held), label="source")
            if source.size == 0:
                continue
            pick = data.draw(st.lists(st.integers(0, source.size - 1), min_size=1, max_size=4))
            handles = source[pick].copy()  # duplicates allowed: two references to one slot
            pool.retain(handles)
            held.append(handles)
        elif op == "release" and held:
            index = data.draw(st.integers(0, len(held) - 1), label="index")
            pool.release(held.pop(index))
        pool.check(held)


def test_slot_reused_only_after_its_count_reaches_zero() -> None:
    """A retained slot survives one release and is handed out again only after the last; the
    low-numbered free slots come first."""
    pool = _pool(2)
    a = pool.alloc(1)
    pool.retain(a)
    pool.release(a)  # one reference left
    b = pool.alloc(1)
    assert unpack(b)[0].tolist() != unpack(a)[0].tolist()
    with pytest.raises(PoolExhausted):
        pool.alloc(1)
    pool.release(a)  # now free
    c = pool.alloc(1)
    assert c.tolist() == a.tolist()
    pool.check([b, c])


def test_shared_ckv_slot_stays_until_every_sharer_releases() -> None:
    """alloc_kr shares the c_KV slot: it is freed only when both the owner and the sharer have
    released it, while the owner's and sharer's k_r slots are independent."""
    pool = _pool(3)
    owner = pool.alloc(1)
    sharer = pool.alloc_kr(unpack(owner)[0])
    assert unpack(sharer)[0].tolist() == unpack(owner)[0].tolist()
    assert unpack(sharer)[1].tolist() != unpack(owner)[1].tolist()
    pool.release(owner)
    pool.check([sharer])
    assert pool.free == 2  # owner's k_r slot is free; the c_KV slot is still shared
    pool.release(sharer)
    pool.check([])
    assert pool.free == 3


def test_release_more_than_retained_raises() -> None:
    """Releasing a slot more often than it was referenced raises, whether in two calls or twice
    within one call."""
    pool = _pool(4)
    h = pool.alloc(2)
    pool.release(h)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(h)
    pool = _pool(4)
    h = pool.alloc(1)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(np.concatenate([h, h]))


def test_failing_release_leaves_counts_unchanged() -> None:
    """A release that raises (one handle over-released) changes no count: the pool still checks
    against the references actually held, and the live slot is not handed out again."""
    pool = _pool(4)
    good, gone = pool.alloc(1), pool.alloc(1)
    pool.release(gone)
    with pytest.raises(RuntimeError):
        pool.release(np.concatenate([good, gone]))
    pool.check([good])
    assert unpack(good)[0][0] not in unpack(pool.alloc(3))[0]


def test_failing_release_across_spaces_leaves_counts_unchanged() -> None:
    """A release that fails in the k_r space does not change the c_KV space either."""
    pool = _pool(4)
    owner = pool.alloc(1)
    sharer = pool.alloc_kr(unpack(owner)[0])
    with pytest.raises(RuntimeError):
        pool.release(np.concatenate([sharer, sharer]))
    pool.check([owner, sharer])


# -- exhaustion ------------------------------------------------------------------------------------

def test_pool_exhausted_when_full_and_failure_changes_nothing() -> None:
    """alloc beyond the free slots raises PoolExhausted (a RuntimeError) and leaves the pool as it
    was; alloc_kr raises when the k_r space is full without retaining the shared c_KV slots."""
    pool = _pool(4)
    held = [pool.alloc(3)]
    with pytest.raises(PoolExhausted, match="need 2"):
        pool.alloc(2)
    pool.check(held)
    held.append(pool.alloc(1))
    assert pool.free == 0
    with pytest.raises(PoolExhausted):
        pool.alloc(1)
    with pytest.raises(PoolExhausted):
        pool.alloc_kr(unpack(held[0])[0][:1])
    pool.check(held)
    assert issubclass(PoolExhausted, RuntimeError)
    pool.release(held.pop())
    held.append(pool.alloc(1))
    pool.check(held)


# -- rows ------------------------------------------------------------------------------------------

def write(pool: KVPool, handles: np.ndarray, rows: list[torch.Tensor]) -> None:
    """Store per-layer rows [n, rank + rope] at handles, as a forward's PagedKV.store does."""
    ckv, kr = (torch.from_numpy(s) for s in unpack(handles))
    for layer, row in enumerate(rows):
        pool.ckv[layer, ckv] = row[:, :RANK]
        pool.kr[layer, kr] = row[:, RANK:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_rows_round_trip_per_layer(dtype: torch.dtype) -> None:
    """rows(handles) returns, per layer, exactly the [c_KV | k_r] rows stored at those handles,
    in the order asked; a handle sharing a c_KV slot sees the owner's c_KV and its own k_r."""
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(LAYERS, 16, RANK, ROPE, dtype=dtype)
    a, b = pool.alloc(5), pool.alloc(3)
    rows_a = [torch.randn(5, RANK + ROPE, generator=gen).to(dtype) for _ in range(LAYERS)]
    rows_b = [torch.randn(3, RANK + ROPE, generator=gen).to(dtype) for _ in range(LAYERS)]
    write(pool, a, rows_a)
    write(pool, b, rows_b)
    for layer, got in enumerate(pool.rows(a)):
        assert got.dtype == dtype
        assert torch.equal(got, rows_a[layer])
    order = np.array([2, 0, 1])
    for layer, got in enumerate(pool.rows(b[order])):
        assert torch.equal(got, rows_b[layer][order])
    # a sharer: same c_KV slots as a[1:3], its own k_r slots
    sharer = pool.alloc_kr(unpack(a[1:3])[0])
    own = [torch.randn(2, RANK + ROPE, generator=gen).to(dtype) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        own[layer][:, :RANK] = rows_a[layer][1:3, :RANK]  # the shared content
    write(pool, sharer, own)
    for layer in range(LAYERS):
        assert torch.equal(pool.rows(sharer)[layer], own[layer])
        assert torch.equal(pool.rows(a)[layer], rows_a[layer])  # owner's k_r untouched
    # an empty gather
    assert all(r.shape == (0, RANK + ROPE) for r in pool.rows(np.zeros(0, dtype=np.int64)))


# -- check() ---------------------------------------------------------------------------------------

def test_check_catches_a_corrupted_count() -> None:
    """check() raises when a count is higher or lower than the references say, and when the free
    list disagrees with the counts; it passes on the true references."""
    pool = _pool(6)
    a, b = pool.alloc(2), pool.alloc(2)
    pool.check([a, b])
    with pytest.raises(AssertionError, match="reference counts off"):
        pool.check([a])  # b's counts are 1, references say 0
    with pytest.raises(AssertionError, match="reference counts off"):
        pool.check([a, b, a[:1]])  # one reference too many
    pool.retain(a[:1])  # an unrecorded reference: the count is corrupted relative to the holders
    with pytest.raises(AssertionError, match="reference counts off at slots \\[0\\]"):
        pool.check([a, b])
    pool.release(a[:1])
    pool.check([a, b])
    # a free slot counted as referenced: counts match the references but the free list disagrees
    free_handle = pack(np.array([5]), np.array([5]))
    pool.retain(free_handle)
    with pytest.raises(AssertionError, match="free list"):
        pool.check([a, b, free_handle])


def test_slot_spaces_must_be_nonempty() -> None:
    """A pool without c_KV or k_r slots is refused, naming both counts."""
    with pytest.raises(ValueError, match="0 c_KV and 4 k_r"):
        _pool(0, 4)
    with pytest.raises(ValueError, match="4 c_KV and 0 k_r"):
        _pool(4, 0)


def test_slots_for_memory_by_hand() -> None:
    """A pool sized by memory: DeepSeek-V2-Lite's 27 layers × (512 + 64) bf16 values per slot
    pair (31,104 bytes); with k_r slots given, their 27 × 64 × 2 bytes come off first."""
    from irminsul.config import ServerConfig
    from irminsul.engine.kv_pool import slots_for_memory

    pair = 27 * (512 + 64) * 2
    assert pair == 31_104
    assert slots_for_memory(27, 512, 64, torch.bfloat16, 1000 * pair + pair - 1) == 1000
    budget = 1000 * pair
    kr = 3000  # three times the slots' worth of k_r rows
    want = (budget - kr * 27 * 64 * 2) // (27 * 512 * 2)
    assert slots_for_memory(27, 512, 64, torch.bfloat16, budget, kr) == want == 750
    assert slots_for_memory(27, 512, 64, torch.float32, pair) == 0
    with pytest.raises(ValueError, match="kv_memory"):
        ServerConfig(kv_memory=1.0)
