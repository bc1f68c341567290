"""A rank that dies, raises or hangs stops the others with a RankFailure that says so, within a
bound, instead of leaving them blocked in a collective."""

from __future__ import annotations

import os
import time

import pytest
from parallel_ranks import run_ranks
from tiny_parallel import tiny_model

from irminsul.config import EngineConfig
from irminsul.engine import ModelRunner
from irminsul.parallel import ParallelGroup, RankFailure, follow, leader_engine
from irminsul.parallel.shard import shard_model

CONFIG = EngineConfig(mode="live", slots=256)
PROMPT = list(range(5, 45))


def serve_until(group: ParallelGroup, failing: int, how: str) -> float:
    """Serve a prompt, then greedy tokens, on a two-layer model; rank ``failing`` fails after
    its first forward (``how``: exit, raise or hang). Returns the seconds a survivor took
    between that forward and its error; raises that error."""
    model = shard_model(tiny_model("v3_like", layers=2), group)
    start = [0.0]

    def fail(out: object) -> object:
        start[0] = time.monotonic()
        if group.rank == failing:
            if how == "exit":
                os._exit(3)
            if how == "hang":
                time.sleep(3600)
            raise ValueError("rank failed on purpose")
        return out

    if group.leader:  # after the step, outside the runner: the leader's own error
        engine = leader_engine(model, CONFIG, group)
        runner = engine.runner
        forward = runner.forward
        runner.forward = lambda batch, *, all_logits=False: fail(
            forward(batch, all_logits=all_logits))
    else:  # the runners follow() builds, in this rank's process alone
        forward = ModelRunner.forward
        ModelRunner.forward = lambda self, batch, *, all_logits=False: fail(
            forward(self, batch, all_logits=all_logits))
    try:
        if group.leader:
            try:
                engine.generate(PROMPT, 8)
            except BaseException as err:
                if group.rank != failing or how != "raise":
                    raise
                runner.stop(f"{type(err).__name__}: {err}")  # what a leader does on an error
                raise
            runner.stop()
        else:
            follow(model, group)
    except RankFailure as err:
        raise RankFailure(f"after {time.monotonic() - start[0]:.1f} s: {err}") from err
    return -1.0


def seconds(error: str) -> float:
    return float(error.split("after ", 1)[1].split(" s:", 1)[0])


@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_that_exits_stops_the_other_at_once(failing: int) -> None:
    """The dead rank's connections close: the survivor's next collective fails, whichever side
    it is on (the leader sending a step, a follower waiting for one), long before any timeout."""
    outcomes = run_ranks(serve_until, 2, failing, "exit", collective_timeout_s=30, timeout_s=120)
    dead, survivor = outcomes[failing], outcomes[1 - failing]
    assert dead.exitcode == 3 and dead.error is None
    assert survivor.error is not None and survivor.error.startswith("RankFailure"), survivor
    assert "a peer rank stopped" in survivor.error
    assert seconds(survivor.error) < 10, survivor.error


def test_a_leader_that_raises_stops_the_followers_with_its_error() -> None:
    outcomes = run_ranks(serve_until, 2, 0, "raise", timeout_s=120)
    assert outcomes[0].error == "ValueError: rank failed on purpose"
    assert outcomes[1].error is not None
    assert "the leader stopped: ValueError: rank failed on purpose" in outcomes[1].error
    # Both ended by themselves: the leader after leaving the group, the follower by abort.
    assert [o.exitcode for o in outcomes] == [0, 1]


def test_a_follower_that_hangs_fails_the_leader_after_the_timeout() -> None:
    """A follower stuck after its forward never joins the next step's all-reduce: the leader's
    waits ``timeout_s`` (here 3 s) and fails; the hung rank is killed by the harness."""
    outcomes = run_ranks(serve_until, 2, 1, "hang", collective_timeout_s=3, timeout_s=60,
                         wait_for=[0])
    leader, hung = outcomes
    assert hung.error is None and hung.exitcode is not None and hung.exitcode < 0  # killed
    assert leader.exitcode == 1  # the leader's process ended by itself (parallel.abort)
    assert leader.error is not None and leader.error.startswith("RankFailure"), leader
    assert "did not answer within 3 s" in leader.error
    assert 2 <= seconds(leader.error) < 20, leader.error


def test_leader_and_follower_roles_are_checked() -> None:
    model = tiny_model("v3_like", layers=1)
    group = ParallelGroup(1, 2, None, None, 1.0)
    with pytest.raises(ValueError, match="rank 1 is a follower"):
        leader_engine(model, CONFIG, group)
    leader = ParallelGroup(0, 2, None, None, 1.0)
    with pytest.raises(ValueError, match="rank 0 leads"):
        follow(model, leader)
    # A share whose partial outputs are not summed over the group would compute wrong logits.
    with pytest.raises(ValueError, match="call shard_model"):
        leader_engine(model, CONFIG, leader)
    with pytest.raises(ValueError, match="call shard_model"):
        follow(model, ParallelGroup(1, 2, None, None, 1.0))
