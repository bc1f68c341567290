"""The followers' copy of the key handles (irminsul.parallel.keys): every batch a follower decodes
is the leader's batch exactly, and a decode step sends each request's new handle only. Driven by
a real engine's batches (prefill chunks, decode steps, forks, PIC reuse, finished sequences), and
by hand-made cases for what must fall back to a whole array."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from tiny_parallel import tiny_model

from irminsul.config import EngineConfig
from irminsul.engine import Engine, ModelRunner
from irminsul.engine.batch import ForwardBatch
from irminsul.parallel.keys import KeyMirror


def same(a: ForwardBatch, b: ForwardBatch) -> bool:
    return (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.new, b.new)
            and len(a.keys) == len(b.keys)
            and all(np.array_equal(x, y) for x, y in zip(a.keys, b.keys))
            and all(np.array_equal(x, y) for x, y in zip(a.positions, b.positions)))


def batch(*items: tuple[list[int], int]) -> ForwardBatch:
    """Items of (keys, new tokens at the end)."""
    keys = [np.array(k, dtype=np.int64) for k, _ in items]
    positions = [np.arange(len(k) - n, len(k)) for k, n in items]
    return ForwardBatch(np.zeros(sum(n for _, n in items), dtype=np.int64), positions, keys,
                        np.concatenate([k[-n:] for k, (_, n) in zip(keys, items)]))


class Recording(ModelRunner):
    """Copies every forward's batch as it was passed (later steps may reuse the buffers)."""

    batches: list[ForwardBatch] = []

    def forward(self, batch, *, all_logits=False):
        Recording.batches.append(ForwardBatch(batch.tokens.copy(),
                                              [p.copy() for p in batch.positions],
                                              [np.array(k) for k in batch.keys],
                                              batch.new.copy()))
        return super().forward(batch, all_logits=all_logits)


def test_a_served_workload_is_mirrored_exactly_and_decode_sends_one_handle() -> None:
    rng = np.random.default_rng(0)
    engine = Engine(tiny_model("v3_like", layers=1, seed=2),
                    EngineConfig(mode="live", slots=4000, chunk_tokens=64), runner=Recording)
    doc = rng.integers(0, 97, 300)
    first = np.concatenate([rng.integers(0, 97, 40), doc])
    moved = np.concatenate([rng.integers(0, 97, 50), doc, rng.integers(0, 97, 10)])
    Recording.batches = []
    engine.generate(first, 6, resets=[40])
    seq, _ = engine.prefill(moved, [50, 350])
    assert seq.stats.pic_tokens > 200  # the document was reused, moved
    twin = engine.fork(seq)
    for step in range(12):  # two sequences sharing a prefix, decoding in turn and together
        engine.extend(seq, [step % 97])
        if step % 3:
            engine.extend(twin, [(step * 7) % 97])
    engine.finish(seq)
    engine.finish(twin)
    engine.generate(moved, 4, resets=[50, 350])  # a prefix hit on the finished sequence
    leader, follower = KeyMirror(stale=4), KeyMirror(stale=4)
    sent = []
    for b in Recording.batches:
        message = leader.encode(b)
        message = pickle.loads(pickle.dumps(message))  # as the control group carries it
        assert same(follower.decode(message), b)
        sent.append(message)
    decode_steps = [m for m, b in zip(sent, Recording.batches)
                    if all(len(p) == 1 for p in b.positions) and max(map(len, b.keys)) > 300]
    assert len(decode_steps) >= 10
    # After a sequence's first step, each decode step sends its one new handle.
    assert sum(len(s) == 1 for m in decode_steps for _, s in m.keys) >= len(decode_steps) - 3
    total = sum(len(k) for b in Recording.batches for k in b.keys)
    assert sum(len(s) for m in sent for _, s in m.keys) < total / 4


def test_what_does_not_extend_a_mirrored_array_is_sent_whole() -> None:
    leader, follower = KeyMirror(stale=2), KeyMirror(stale=2)

    def send(b: ForwardBatch) -> list[int]:
        message = leader.encode(b)
        assert same(follower.decode(message), b)
        return [len(s) for _, s in message.keys]

    assert send(batch(([1, 2, 3], 3))) == [3]
    assert send(batch(([1, 2, 3, 4], 1))) == [1]  # a decode step: the new handle
    # Handle 4 freed and reused by another sequence whose prefix differs: checked, sent whole.
    assert send(batch(([9, 8, 4, 5], 1))) == [4]
    # Two forks of one sequence in one batch: the first extends it, the second is sent whole,
    # then each extends its own.
    assert send(batch(([1, 2, 3, 4, 6], 1), ([1, 2, 3, 4, 7], 1))) == [1, 5]
    assert send(batch(([1, 2, 3, 4, 6, 10], 1), ([1, 2, 3, 4, 7, 11], 1))) == [1, 1]
    # A sequence whose earlier handles were replaced (the same last handle, other content).
    assert send(batch(([1, 2, 33, 4, 6, 10, 12], 1))) == [7]
    # Unused for more than `stale` forwards: dropped on both sides, then sent whole again.
    for _ in range(3):
        send(batch(([50, 51], 1)))
    assert send(batch(([1, 2, 3, 4, 7, 11, 13], 1))) == [7]
    assert leader.arrays.keys() == follower.arrays.keys()
    assert all(np.array_equal(leader.arrays[i].view(), follower.arrays[i].view())
               for i in leader.arrays)


def test_a_follower_out_of_step_is_an_error() -> None:
    leader, follower = KeyMirror(stale=1), KeyMirror(stale=1)
    follower.decode(leader.encode(batch(([1, 2], 2))))
    leader.encode(batch(([5], 1)))  # a message the follower never got
    with pytest.raises(RuntimeError, match="out of step"):
        follower.decode(leader.encode(batch(([5, 6], 1))))
