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

Rank failure is the group's (:mod:`.group`): a peer that dies fails the next all-reduce or
exchange at once, one that hangs after the collective timeout, with :class:`RankFailure`.

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
from .group import ParallelGroup, guarded
from .shard import check_sharded

T = TypeVar("T")


class LockstepRunner(ModelRunner):
    """A rank's model runner under data-parallel attention: every model call is a step of all
    the ranks (module docstring). Graphs off."""

    def __init__(self, model: MLAModel, ckv: torch.Tensor, kr: torch.Tensor, *,
                 group: ParallelGroup, graphs: bool, **kwargs: Any) -> None:
        if graphs:
            raise ValueError("CUDA graphs under data-parallel attention are not built yet; run "
                             "with graphs off")
        super().__init__(model, ckv, kr, graphs=False, **kwargs)
        self.group = group
        self.steps = 0  # steps of the ranks this runner took part in
        self.joined = 0  # of them, steps where it ran fewer layers than a peer
        self._last = 0  # the layers of the latest step, the most any rank ran

    def forward(self, batch: ForwardBatch, *, all_logits: bool = False) -> list[torch.Tensor]:
        return self._step(self._layers,
                          lambda: super(LockstepRunner, self).forward(batch, all_logits=all_logits))

    def recompute(self, prompt: np.ndarray) -> torch.Tensor:
        return self._step(self._layers, lambda: super(LockstepRunner, self).recompute(prompt))

    def check_latent(self, prompt: np.ndarray, positions: np.ndarray,
                     ckv_slots: np.ndarray) -> np.ndarray:
        return self._step(self.check_depth, lambda: super(LockstepRunner, self).check_latent(
            prompt, positions, ckv_slots))

    def idle(self) -> bool:
        """This rank's turn when it has nothing to run: join whatever step its peers take, with
        no rows. Whether any rank ran something (False: every rank was idle this turn)."""
        self._step(0, lambda: None)
        return self._last > 0

    @property
    def _layers(self) -> int:
        return len(self.model.model.layers)

    def _step(self, layers: int, run: Callable[[], T]) -> T:
        most = torch.tensor([layers], dtype=torch.int64, device=self.ckv.device)
        with guarded(self.group, "agreeing on a step's layers"):
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group.device_group)
        self._last = int(most)
        if self._last == 0:
            return run()
        self.steps += 1
        out = run()
        if layers < self._last:
            self.joined += 1
            self.model.idle(layers, self._last)
        return out


def lockstep_engine(model: MLAModel, config: EngineConfig, group: ParallelGroup) -> Engine:
    """This rank's engine over its data-parallel share ``model`` (:func:`~.shard.shard_model`
    with ``attention="data"``), its runner a :class:`LockstepRunner`; the config runs with
    graphs off. Every rank builds its own."""
    if model.attention_mode != "data" and group.world_size > 1:
        raise ValueError("lockstep engines run a data-parallel share: shard_model(model, group, "
                         "attention='data')")
    check_sharded(model, group)
    config = dataclasses.replace(config, graphs=False)

    def make(*args: Any, **kwargs: Any) -> LockstepRunner:
        return LockstepRunner(*args, group=group, **kwargs)

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
