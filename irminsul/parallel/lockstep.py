"""Data-parallel attention's engines: one per rank, each with its own requests; their model calls
in lockstep.

Under data-parallel attention (:func:`~.shard.shard_model` with ``attention="data"``) each rank
serves its own requests with every attention head and its own latent pool, so each rank runs a
whole engine of its own — scheduler, planner, chunk registry, radix tree, pool — and PIC runs
in it unchanged. What couples the ranks is the MoE: every MoE layer exchanges rows with every
other rank (:mod:`.dispatch`), so a rank can run a layer only while all the others run the same
layer.

:class:`LockstepRunner` makes each model call of its engine (a forward, the audit's
recomputation, repair's check forward) a step of all the ranks: before it, the ranks agree on
how many layers the step runs (one all-reduce of one integer, its maximum over the ranks),
each runs its own call, and a rank whose call runs fewer layers — a check forward runs only the
first few, a rank with nothing to do none — joins the remaining MoE exchanges with no rows
(:meth:`~irminsul.model.MLAModel.idle`). A rank with nothing to run must still answer its
peers' steps: its loop calls :meth:`LockstepRunner.idle` whenever its scheduler has no work
(:func:`run_in_lockstep`). A rotation or a write of fetched rows touches only the rank's own
pool and runs without the others.

A stop is agreed the same way: a rank that stops announces it in its last turn
(``idle(stop=True)``), every rank learns it in that same turn (:attr:`LockstepRunner.stopped`),
and from then on no rank starts another step (a call raises :class:`RanksStopped` without
touching the group), so none is left waiting in a collective for a rank that has gone.

Rank failure is the group's (:mod:`.group`): a peer that dies fails the next all-reduce or
exchange at once, one that hangs after the collective timeout, with :class:`RankFailure`. A call
that raises after its step began (the ranks may be out of step) is kept as the runner's
:attr:`~LockstepRunner.failure`: ``on_failure`` is told, and every later call raises
:class:`RankFailure` at once.

CUDA graphs: a step replays graphs only if every rank's call is a forward that would replay one
(or nothing); the step's one all-reduce also carries each rank's tokens and whether its call
runs eagerly, so every rank knows before it runs whether the step is replayed and in which
bucket — the least that holds the largest batch — and each pads its batch to that bucket (a rank
with nothing to run replays the bucket's padding alone). The graphs' exchanges have fixed sizes
(:func:`~.dispatch.fixed_capacity`: captured in them, no host read), so they line up across
ranks only because the buckets do. Otherwise every rank runs eagerly with the counted exchange.
A step is never launched ahead of its token ids (:attr:`stages_ahead`): the ranks agree on it
first.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..engine import Engine, Scheduler
from ..engine.batch import ForwardBatch
from ..engine.model_runner import ModelRunner
from ..engine.scheduler import StepOutput
from ..model import MLAModel
from .dispatch import fixed_capacity
from .group import ParallelGroup, RankFailure, guarded
from .leader import resolved
from .shard import check_sharded

T = TypeVar("T")


class RanksStopped(RuntimeError):
    """A rank announced its stop: no step runs on any rank any more."""


class LockstepRunner(ModelRunner):
    """A rank's model runner under data-parallel attention: every model call is a step of all
    the ranks (module docstring). ``on_failure``: told (on the engine's thread) what failed,
    once, when a step fails on this rank."""

    lockstep = True
    stages_ahead = False  # the ranks agree on each step's bucket before it runs

    def __init__(self, model: MLAModel, ckv: torch.Tensor, kr: torch.Tensor, *,
                 group: ParallelGroup,
                 on_failure: Callable[[str, BaseException], None] | None = None,
                 **kwargs: Any) -> None:
        # Graphs are captured here (on a GPU), each bucket's exchanges in fixed sizes; every
        # rank builds its engine at once, so the captures' warm-up forwards meet.
        with fixed_capacity():
            super().__init__(model, ckv, kr, **kwargs)
        self.group = group
        self.on_failure = on_failure
        self.failure: BaseException | None = None
        self.steps = 0  # steps of the ranks this runner took part in
        self.joined = 0  # of them, steps where it ran fewer layers than a peer
        self._last = 0  # the layers of the latest step, the most any rank ran
        self._stopped = False
        self._turns = 0

    @property
    def stopped(self) -> bool:
        """A rank announced its stop (this one included): no step runs any more."""
        return self._stopped

    @property
    def turns(self) -> int:
        """The turns this rank has taken: each all-reduce of a step's layers."""
        return self._turns

    def forward(self, batch: ForwardBatch, *, all_logits: bool = False) -> list[torch.Tensor]:
        kernel, gathered, merged = self._route(batch)
        last = None if all_logits else np.cumsum(batch.lengths) - 1

        def run(bucket: int) -> list[torch.Tensor]:
            if not bucket:
                return self._eager(batch, kernel, gathered, merged, last)
            with fixed_capacity():
                return self.replay(self._stage(batch, kernel, last, bucket), batch.tokens)

        graphed = self._graphed(batch, kernel, gathered, merged)
        return self._step(self._layers, run, tokens=batch.tokens.size if graphed else None)

    def recompute(self, prompt: np.ndarray) -> torch.Tensor:
        return self._step(self._layers, lambda _: super(LockstepRunner, self).recompute(prompt))

    def check_latent(self, prompt: np.ndarray, positions: np.ndarray,
                     ckv_slots: np.ndarray) -> np.ndarray:
        return self._step(self.check_depth, lambda _: super(LockstepRunner, self).check_latent(
            prompt, positions, ckv_slots))

    def idle(self, stop: bool = False) -> bool:
        """This rank's turn when it has nothing to run: join whatever step its peers take, with
        no rows; ``stop``: announce this rank's stop too. Whether any rank ran something (False:
        every rank was idle this turn)."""
        self._step(0, lambda _: None, stop)
        return self._last > 0

    @property
    def _layers(self) -> int:
        return len(self.model.model.layers)

    def _pad(self, bucket: int) -> None:
        """This rank's part in a replayed step it has nothing for: the bucket's graph over
        padding alone (its exchanges are the others' counterparts)."""
        empty = np.zeros(0, dtype=np.int64)
        with fixed_capacity():
            self.graphs.replay(self.graphs.stage(empty, empty, empty, [], empty, bucket), empty)

    def _step(self, layers: int, run: Callable[[int], T], stop: bool = False,
              tokens: int | None = None) -> T:
        """One step of all the ranks: this rank's call runs ``layers`` layers (0: none),
        ``run(bucket)`` runs it (bucket 0: eagerly); ``tokens``: it is a forward of that many
        tokens that would replay a graph (None: it runs eagerly)."""
        if self.failure is not None:
            raise RankFailure(f"rank {self.group.rank} of {self.group.world_size}: a step failed "
                              f"earlier ({self.failure}); no more run on these ranks")
        if self._stopped:
            raise RanksStopped(f"rank {self.group.rank}: the ranks are stopping")
        try:
            # [layers, stop, graphed tokens, eager], their maxima over the ranks: one
            # all-reduce a step.
            eager = int(layers > 0 and tokens is None)
            agreed = torch.tensor([layers, int(stop), tokens or 0, eager], dtype=torch.int64,
                                  device=self.ckv.device)
            with guarded(self.group, "agreeing on a step"):
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group.device_group)
            self._turns += 1
            most, self._stopped, widest, any_eager = (int(v) for v in agreed.tolist())
            self._last = most
            if most == 0:
                return run(0)
            self.steps += 1
            self.joined += layers < most
            if self.graphs is not None and not any_eager:  # every rank replays this bucket
                bucket = self.graphs.bucket(widest)
                if layers == 0:
                    self._pad(bucket)
                    return run(0)
                return run(bucket)
            out = run(0)
            if layers < most:
                self.model.idle(layers, most)
            return out
        except BaseException as err:
            self.failure = err
            if self.on_failure is not None:
                self.on_failure("a step", err)
            raise


def rendezvous(group: ParallelGroup, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` until every rank gets here: before a rank's first lockstep step,
    whose all-reduce waits only the collective timeout, while a rank's load of its share may
    take minutes longer than another's (tensor parallel's first engine waits the same way).
    Over the control group (gloo, no timeout of its own beyond this wait)."""
    with guarded(group, "waiting for the other ranks to load"):
        dist.all_reduce(torch.zeros(1), group=group.control_group, async_op=True).wait(
            timedelta(seconds=timeout_s))


def lockstep_engine(model: MLAModel, config: EngineConfig, group: ParallelGroup, *,
                    runner: type[ModelRunner] = ModelRunner,
                    on_failure: Callable[[str, BaseException], None] | None = None) -> Engine:
    """This rank's engine over its data-parallel share ``model`` (:func:`~.shard.shard_model`
    with ``attention="data"``), its runner a :class:`LockstepRunner` over ``runner``'s
    rotation and forward (the PIC gate's naive-reuse runner, say; ``on_failure``: its), with
    CUDA graphs only where ``config`` asks for them (True: :func:`~.leader.resolved`). Every
    rank builds its own, at once. Its signature is
    :class:`~irminsul.engine.Engine`'s after ``group``, so it can stand where an engine is
    built (the gate, the server)."""
    if model.attention_mode != "data" and group.world_size > 1:
        raise ValueError("lockstep engines run a data-parallel share: shard_model(model, group, "
                         "attention='data')")
    check_sharded(model, group)
    config = resolved(model, config)
    if issubclass(runner, LockstepRunner):
        raise ValueError(f"{runner.__name__} already runs in lockstep: pass the runner to wrap")
    stepping = LockstepRunner if runner is ModelRunner else type(
        f"Lockstep{runner.__name__}", (LockstepRunner, runner), {})

    def make(*args: Any, **kwargs: Any) -> LockstepRunner:
        return stepping(*args, group=group, on_failure=on_failure, **kwargs)

    return Engine(model, config, runner=make)


def run_in_lockstep(scheduler: Scheduler) -> list[StepOutput]:
    """Step this rank's ``scheduler`` (over a :func:`lockstep_engine`) until it and every other
    rank's are out of work, answering the other ranks' steps while it has none; what its steps
    produced. Every rank calls it, with all of its requests added."""
    runner = scheduler.engine.runner
    if not isinstance(runner, LockstepRunner):
        raise ValueError("run_in_lockstep needs a lockstep_engine's scheduler")
    outputs: list[StepOutput] = []
    while scheduler.has_work() or runner.idle():  # idle() False: every rank idle at once
        if scheduler.has_work():
            outputs += scheduler.step()
    return outputs
