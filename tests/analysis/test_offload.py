"""A pass run in a forked process sees every prompt in order and hands back what it computed,
as running it here does; a failure in the child is raised in the caller."""

from __future__ import annotations

import os

import pytest

from irminsul.analysis.offload import BATCH, offload


class Collect:
    """A pass whose result is everything it was given, in order, and the process it ran in."""

    def __init__(self) -> None:
        self.seen: list = []

    def add(self, prompt: object) -> None:
        self.seen.append(prompt)

    def result(self) -> dict:
        return {"seen": self.seen, "pid": os.getpid()}


class Failing(Collect):
    def add(self, prompt: object) -> None:
        if prompt == 5:
            raise ValueError("prompt 5 is bad")
        super().add(prompt)


class Dying(Collect):
    def add(self, prompt: object) -> None:
        os._exit(3)


@pytest.mark.parametrize("count", [0, 1, BATCH, 3 * BATCH + 5])
def test_a_forked_pass_sees_every_prompt_in_order(count: int) -> None:
    prompts = [(i, "x" * (i % 7)) for i in range(count)]
    forked = offload(Collect, fork=True)
    for prompt in prompts:
        forked.add(prompt)
    result = forked.result()
    assert result["seen"] == prompts
    assert result["pid"] != os.getpid()
    here = offload(Collect, fork=False)
    for prompt in prompts:
        here.add(prompt)
    assert here.result() == {"seen": prompts, "pid": os.getpid()}


def test_an_error_in_the_child_is_raised_in_the_caller() -> None:
    forked = offload(Failing, fork=True)
    with pytest.raises(ValueError, match="prompt 5 is bad"):
        for prompt in range(10 * BATCH):
            forked.add(prompt)
        forked.result()
    forked.close()


def test_a_child_that_dies_is_reported() -> None:
    forked = offload(Dying, fork=True)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        for prompt in range(1000 * BATCH):  # more than the queue holds: the caller must notice
            forked.add(prompt)
        forked.result()
    forked.close()


def test_analyze_in_processes_equals_analyze_in_one() -> None:
    """The whole report of a sample log, rendered by two workers with the replay in a process of
    its own, equals the report computed entirely in this process (but for the time taken)."""
    from irminsul.analysis.analyze import analyze_log
    from irminsul.traffic.logs import sample_logs
    from irminsul.traffic.render import ChatRenderer

    reports = [analyze_log(sample_logs()[1], ChatRenderer.default(), progress=False,
                           workers=workers) for workers in (1, 2)]
    for report in reports:
        report.pop("seconds")
    assert reports[0] == reports[1]
    assert reports[0]["replay"]["default"]["pic_unique"] > 0
