"""One scheduler and one cache manager decide; the ranks follow.

Rank 0 (the leader) runs the whole engine — scheduler, planner, cache manager, sampling — with a
:class:`LeaderRunner` as its model runner. Every call the engine makes on its runner that moves
rows (a reuse's δ-rotation, a forward) is broadcast to the followers as one message — the
batch's tokens, positions and slots, or the reuse's slots and δs: once per step, not per layer —
and then run on the leader. Each follower runs :func:`follow`: the same calls, in the same order,
on a :class:`ModelRunner` of its own over its own pool of the same shape. The runners are
deterministic and the all-reduces give every rank the same bits, so every rank's latent pool
holds the same rows in the same slots, and the slot accounting lives on the leader alone.

Not built yet: CUDA graphs under a leader (staging a batch ahead of its token ids is a second
message per step); the live-PIC audit and the repair's latent check (``recompute_share``), which
run the model outside the runner and would leave the followers out of its all-reduces
(:func:`leader_engine` turns the first off and refuses the second). The message carries each
item's key handles (8 bytes per context token per step); mirroring them on the followers, so
that a step sends only its new tokens' handles, is the next step for long-context decoding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ..config import EngineConfig
from ..engine import Engine
from ..engine.batch import ForwardBatch, Reuse
from ..engine.model_runner import ModelRunner
from ..model import MLAModel
from .group import ParallelGroup, RankFailure, broadcast

ROTATE, FORWARD, STOP = "rotate", "forward", "stop"


class LeaderRunner(ModelRunner):
    """Rank 0's model runner: each rotation and forward goes to the followers, then runs here.
    :meth:`stop` must end its life (it releases the followers).

    Any error inside a step (a rank failed, or this one raised between the broadcast and the
    end of its forward, where a follower may be waiting in an all-reduce this rank will never
    join) leaves the ranks out of step: the runner keeps it as :attr:`failure`, tells
    ``on_failure`` (on the engine's thread), and from then on every step raises
    :class:`RankFailure` at once, without touching the group. :attr:`doing` names the step in
    progress (None between steps), for the message that reports a failure."""

    def __init__(self, model: MLAModel, ckv: torch.Tensor, kr: torch.Tensor, *,
                 group: ParallelGroup, graphs: bool,
                 on_failure: Callable[[BaseException], None] | None = None,
                 **kwargs: Any) -> None:
        if not group.leader:
            raise ValueError(f"rank {group.rank} is a follower: it runs follow(), not a leader")
        if graphs:
            raise ValueError("CUDA graphs under tensor parallel are not built yet; run with "
                             "graphs off")
        super().__init__(model, ckv, kr, graphs=False, **kwargs)
        self.group = group
        self.on_failure = on_failure
        self.failure: BaseException | None = None
        self.doing: str | None = None

    def rotate(self, reuse: Reuse) -> None:
        self._step("a rotation", (ROTATE, reuse), lambda: super(LeaderRunner, self).rotate(reuse))

    def forward(self, batch: ForwardBatch, *, all_logits: bool = False) -> list[torch.Tensor]:
        return self._step("a forward", (FORWARD, batch, all_logits),
                          lambda: super(LeaderRunner, self).forward(batch, all_logits=all_logits))

    def _step(self, what: str, message: tuple, run: Callable[[], Any]) -> Any:
        if self.failure is not None:
            raise RankFailure(f"rank 0 of {self.group.world_size}: the ranks failed earlier "
                              f"({self.failure}); nothing more runs on them")
        self.doing = what
        try:
            broadcast(self.group, message)
            return run()
        except BaseException as err:
            self.failure = err
            if self.on_failure is not None:
                self.on_failure(err)
            raise
        finally:
            self.doing = None

    def stop(self, error: str | None = None) -> None:
        """Release the followers: they return from :func:`follow`, or, given ``error`` (why the
        leader is stopping), raise :class:`RankFailure` with it. A no-op after a failure (the
        group is broken; the followers learn of it by themselves)."""
        if self.failure is None:
            broadcast(self.group, (STOP, error))


def leader_runner(group: ParallelGroup,
                  on_failure: Callable[[BaseException], None] | None = None
                  ) -> Callable[..., LeaderRunner]:
    """The ``runner`` argument of :class:`~irminsul.engine.Engine` on the leader."""
    return partial(LeaderRunner, group=group, on_failure=on_failure)


def leader_engine(model: MLAModel, config: EngineConfig, group: ParallelGroup, *,
                  on_failure: Callable[[BaseException], None] | None = None) -> Engine:
    """The leader's engine over its shard of the model: ``config`` with graphs off and the
    live-PIC audit off (it recomputes a prompt with the model directly, outside the runner, so
    the followers would miss its all-reduces); the repair's latent check is refused for the
    same reason. ``on_failure``: see :class:`LeaderRunner`."""
    if config.cache.recompute_share:
        raise ValueError("recompute_share runs the model outside the runner: not built under "
                         "tensor parallel yet")
    return Engine(model, dataclasses.replace(config, graphs=False, pic_audit_rate=0.0),
                  runner=leader_runner(group, on_failure))


def follower_engine(model: MLAModel, config: EngineConfig) -> Engine:
    """A follower's engine: its pool shaped as the leader's (the same ``config``, graphs off);
    only its runner is used, by :func:`follow`."""
    return Engine(model, dataclasses.replace(config, graphs=False))


def follow(runner: ModelRunner, group: ParallelGroup) -> int:
    """A follower's life: run each rotation and forward the leader broadcasts on ``runner``
    until the leader stops; returns the forwards run. Raises :class:`RankFailure` if the leader
    stops with an error or a rank fails (the follower then exits; nothing is left to serve)."""
    if group.leader:
        raise ValueError("rank 0 leads: it runs the engine with leader_runner(), not follow()")
    forwards = 0
    while True:
        kind, *args = broadcast(group)
        if kind == ROTATE:
            runner.rotate(*args)
        elif kind == FORWARD:
            batch, all_logits = args
            runner.forward(batch, all_logits=all_logits)
            forwards += 1
        elif kind == STOP:
            if args[0] is not None:
                raise RankFailure(f"rank {group.rank} of {group.world_size}: the leader "
                                  f"stopped: {args[0]}")
            return forwards
        else:
            raise RankFailure(f"rank {group.rank}: unknown message {kind!r} from the leader")
