"""bench serve's warm-up: the first calls of the first sessions, sent at once (so batched shapes
compile before the clock starts), replies cut short, a failure reported."""

from __future__ import annotations

import asyncio

from irminsul.loadgen.bench import WARMUP_TOKENS, Load, warm_up
from irminsul.loadgen.client import CallRecord
from irminsul.loadgen.sessions import Call, Session
from irminsul.traffic.logs import Request


def session(i: int, calls: int = 2, max_tokens: int = 256) -> Session:
    return Session(f"s{i}", tuple(
        Call(i, j, Request(f"s{i}", j, [{"role": "user", "content": f"{i}.{j}"}], None, f"t:{i}"),
             max_tokens, True) for j in range(calls)))


class Recorder:
    """A fake send: holds each call until every expected one has arrived, counting how many
    were in flight at once."""

    def __init__(self, expect: int, fail: set[int] = frozenset()) -> None:
        self.expect, self.fail = expect, fail
        self.sent: list[Call] = []
        self.in_flight = self.most = 0
        self.all_in = asyncio.Event()

    async def __call__(self, call: Call) -> CallRecord:
        self.sent.append(call)
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        if len(self.sent) == self.expect:
            self.all_in.set()
        await asyncio.wait_for(self.all_in.wait(), 5)  # one at a time would time out here
        self.in_flight -= 1
        return CallRecord(f"s{call.session}", call.session, call.index, call.index,
                          call.max_tokens, True,
                          error="boom" if call.session in self.fail else None)


def test_first_calls_sent_at_once_replies_cut() -> None:
    sessions = [session(i, max_tokens=256 if i else 8) for i in range(6)]
    send = Recorder(expect=4)
    assert asyncio.run(warm_up(sessions, 4, send)) is None
    assert send.most == 4
    assert [(c.session, c.index) for c in send.sent] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert [c.max_tokens for c in send.sent] == [8, WARMUP_TOKENS, WARMUP_TOKENS, WARMUP_TOKENS]


def test_fewer_sessions_than_warmup_calls_and_errors() -> None:
    send = Recorder(expect=2, fail={1})
    assert asyncio.run(warm_up([session(0), session(1)], 5, send)) == "boom"
    assert send.most == 2
    assert asyncio.run(warm_up([session(0)], 0, Recorder(expect=0))) is None


def test_default_warmup_is_the_concurrency() -> None:
    assert Load(concurrency=32).warmup_calls() == 32
    assert Load(concurrency=None, rate=2.0).warmup_calls() == 4
    assert Load(concurrency=32, warmup=0).warmup_calls() == 0


def test_think_time_between_a_reply_and_the_next_call() -> None:
    """With a think time, each session's next call is sent that long after its previous reply
    came back (the first at once); sessions think side by side, not in turn."""
    import time

    from irminsul.loadgen.runner import run_sessions

    ends: dict[tuple[int, int], float] = {}
    starts: dict[tuple[int, int], float] = {}

    async def send(call: Call, origin: float) -> CallRecord:
        starts[call.session, call.index] = time.perf_counter()
        await asyncio.sleep(0.01)
        ends[call.session, call.index] = time.perf_counter()
        return CallRecord(f"s{call.session}", call.session, call.index, call.index,
                          call.max_tokens, True)

    began = time.perf_counter()
    run = asyncio.run(run_sessions([session(i, calls=3) for i in range(2)], send,
                                   concurrency=2, think=0.1))
    assert len(run.calls) == 6
    for i in range(2):
        assert starts[i, 0] - began < 0.05
        for j in (1, 2):
            assert starts[i, j] - ends[i, j - 1] >= 0.1
    assert run.wall_s < 0.5  # two sessions of 2 thinks each, side by side: ~0.23 s
    assert "0.1 s between a reply and the next call" in Load(think_s=0.1).describe()
