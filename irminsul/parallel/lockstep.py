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

Not built yet: CUDA graphs (the exchange reads its counts back to the host), the server
(``irminsul serve`` with a rank per GPU behind the content router, docs/multi-gpu.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
from .group import ParallelGroup, RankFailure, guarded
from .shard import check_sharded

T = TypeVar("T")


class RanksStopped(RuntimeError):
    """A rank announced its stop: no step runs on any rank any more."""


class LockstepRunner(ModelRunner):
    """A rank's model runner under data-parallel attention: every model call is a step of all
    the ranks (module docstring). Graphs off. ``on_failure``: told (on the engine's thread) what
    failed, once, when a step fails on this rank."""

    lockstep = True

    def __init__(self, model: MLAModel, ckv: torch.Tensor, kr: torch.Tensor, *,
                 group: ParallelGroup, graphs: bool,
                 on_failure: Callable[[str, BaseException], None] | None = None,
                 **kwargs: Any) -> None:
        if graphs:
            raise ValueError("CUDA graphs under data-parallel attention are not built yet; run "
                             "with graphs off")
        super().__init__(model, ckv, kr, graphs=False, **kwargs)
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
        return self._step(self._layers,
                          lambda: super(LockstepRunner, self).forward(batch, all_logits=all_logits))

    def recompute(self, prompt: np.ndarray) -> torch.Tensor:
        return self._step(self._layers, lambda: super(LockstepRunner, self).recompute(prompt))

    def check_latent(self, prompt: np.ndarray, positions: np.ndarray,
                     ckv_slots: np.ndarray) -> np.ndarray:
        return self._step(self.check_depth, lambda: super(LockstepRunner, self).check_latent(
            prompt, positions, ckv_slots))

    def idle(self, stop: bool = False) -> bool:
        """This rank's turn when it has nothing to run: join whatever step its peers take, with
        no rows; ``stop``: announce this rank's stop too. Whether any rank ran something (False:
        every rank was idle this turn)."""
        self._step(0, lambda: None, stop)
        return self._last > 0

    @property
    def _layers(self) -> int:
        return len(self.model.model.layers)

    def _step(self, layers: int, run: Callable[[], T], stop: bool = False) -> T:
        if self.failure is not None:
            raise RankFailure(f"rank {self.group.rank} of {self.group.world_size}: a step failed "
                              f"earlier ({self.failure}); no more run on these ranks")
        if self._stopped:
            raise RanksStopped(f"rank {self.group.rank}: the ranks are stopping")
        try:
            # [layers, stop], their maxima over the ranks: one all-reduce a step.
            agreed = torch.tensor([layers, int(stop)], dtype=torch.int64, device=self.ckv.device)
            with guarded(self.group, "agreeing on a step"):
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group.device_group)
            self._turns += 1
            self._last, self._stopped = int(agreed[0]), bool(agreed[1])
            if self._last == 0:
                return run()
            self.steps += 1
            out = run()
            if layers < self._last:
                self.joined += 1
                self.model.idle(layers, self._last)
            return out
        except BaseException as err:
            self.failure = err
            if self.on_failure is not None:
                self.on_failure("a step", err)
            raise


def lockstep_engine(model: MLAModel, config: EngineConfig, group: ParallelGroup, *,
                    runner: type[ModelRunner] = ModelRunner,
                    on_failure: Callable[[str, BaseException], None] | None = None) -> Engine:
    """This rank's engine over its data-parallel share ``model`` (:func:`~.shard.shard_model`
    with ``attention="data"``), its runner a :class:`LockstepRunner` over ``runner``'s
    rotation and forward (the PIC gate's naive-reuse runner, say; ``on_failure``: its); the
    config runs with graphs off. Every rank builds its own. Its signature is
    :class:`~irminsul.engine.Engine`'s after ``group``, so it can stand where an engine is
    built (the gate, the server)."""
    if model.attention_mode != "data" and group.world_size > 1:
        raise ValueError("lockstep engines run a data-parallel share: shard_model(model, group, "
                         "attention='data')")
    check_sharded(model, group)
    config = dataclasses.replace(config, graphs=False)

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
