"""One scheduler and one cache manager decide; the ranks follow.

Rank 0 (the leader) runs the whole engine — scheduler, planner, cache manager, sampling — with a
:class:`LeaderRunner` as its model runner. Every call the engine makes on its runner that moves
rows (a reuse's δ-rotation, a forward) is broadcast to the followers as one message — the
batch's tokens, positions and slots, or the reuse's slots and δs: once per step, not per layer —
and then run on the leader (a forward's key handles as what changed since the last step,
:mod:`.keys`). Each follower runs :func:`follow`: the same calls, in the same order,
on a :class:`ModelRunner` of its own over its own pool of the same shape. The runners are
deterministic and the all-reduces give every rank the same bits, so every rank's latent pool
holds the same rows in the same slots, and the slot accounting lives on the leader alone.

The leader may run several engines over the same ranks (the PIC gate's full-recomputation, PIC
and naive-reuse engines before the serving one): :func:`leader_engine` opens each on every rank
— its config and runner class, once — under a channel of its own that its messages name, and
:meth:`~irminsul.engine.Engine.close` releases the followers' copy. So anything the leader
measures with engines runs on the sharded model, and no rank ever holds the whole model.

The runner's other work goes the same way, one message each: the live-PIC audit's
recomputation of a prompt from scratch and the repair's check forward (``recompute_share``),
whose all-reduces the followers join, and the rows fetched from a shared store
(:mod:`irminsul.store`), sent with the message so that every pool gets the same ones.

CUDA graphs run on every rank: each rank's runner captures its buckets when the engine opens
(the capture's warm-up forwards join their all-reduces in the same order everywhere, and NCCL's
all-reduce is captured with the rest), and a forward the leader broadcasts replays the same
bucket's graph on every rank, since whether a batch replays depends on the batch alone. What a
leader does not do is launch a step ahead of its token ids (:meth:`ModelRunner.stage`): the
followers would need a second message per step, after the leader's device has sampled, so a
decode step under a leader stages and replays in one call.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..config import CacheConfig, EngineConfig
from ..engine import Engine
from ..engine.batch import ForwardBatch, Reuse
from ..engine.model_runner import ModelRunner, resolve_backend
from ..model import MLAModel
from .group import ParallelGroup, RankFailure, broadcast
from .keys import KeyMirror
from .shard import check_sharded

log = logging.getLogger(__name__)

OPEN, CLOSE, ROTATE, FORWARD, STOP = "open", "close", "rotate", "forward", "stop"
RECOMPUTE, CHECK, WRITE = "recompute", "check", "write"

# The leader names each engine it opens on the ranks; the followers key their copies by it.
_channels = itertools.count()


class LeaderRunner(ModelRunner):
    """Rank 0's model runner on one channel: each rotation and forward goes to the followers,
    then runs here. Subclassed with another runner class (:func:`leader_engine`'s ``runner``)
    it runs that class's rotation and forward, and the followers run the same class.

    Any error inside a step (a rank failed, or this one raised between the broadcast and the
    end of its forward, where a follower may be waiting in an all-reduce this rank will never
    join) leaves the ranks out of step: the runner keeps it as :attr:`failure`, tells
    ``on_failure`` (the step, e.g. ``"a forward"``, and the error; on the engine's thread), and
    from then on every step raises :class:`RankFailure` at once, without touching the group.
    :attr:`doing` names the step in progress (None between steps)."""

    # A step's forward is one message: the followers cannot replay a batch staged ahead of its
    # token ids (see the module's docstring).
    stages_ahead = False

    def __init__(self, model: MLAModel, ckv: torch.Tensor, kr: torch.Tensor, *,
                 group: ParallelGroup, channel: int,
                 on_failure: Callable[[str, BaseException], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(model, ckv, kr, **kwargs)
        self.group, self.channel = group, channel
        self.mirror = KeyMirror()  # the key handles the followers hold (.keys)
        self.on_failure = on_failure
        self.failure: BaseException | None = None
        self.doing: str | None = None

    def rotate(self, reuse: Reuse) -> None:
        self._step("a rotation", (ROTATE, self.channel, reuse),
                   lambda: super(LeaderRunner, self).rotate(reuse))

    def forward(self, batch: ForwardBatch, *, all_logits: bool = False) -> list[torch.Tensor]:
        return self._step("a forward",
                          (FORWARD, self.channel, self.mirror.encode(batch), all_logits),
                          lambda: super(LeaderRunner, self).forward(batch, all_logits=all_logits))

    def write_rows(self, handles: np.ndarray, ckv: torch.Tensor, kr: torch.Tensor) -> None:
        # The rows themselves travel (the shared store's, fetched once by the leader): a
        # follower fetching its own copy could find the store changed in between.
        self._step("a write of fetched rows", (WRITE, self.channel, handles, ckv.cpu(), kr.cpu()),
                   lambda: super(LeaderRunner, self).write_rows(handles, ckv, kr))

    def recompute(self, prompt: np.ndarray) -> torch.Tensor:
        return self._step("a recomputation", (RECOMPUTE, self.channel, prompt),
                          lambda: super(LeaderRunner, self).recompute(prompt))

    def check_latent(self, prompt: np.ndarray, positions: np.ndarray,
                     ckv_slots: np.ndarray) -> np.ndarray:
        return self._step("a latent check", (CHECK, self.channel, prompt, positions, ckv_slots),
                          lambda: super(LeaderRunner, self).check_latent(prompt, positions,
                                                                         ckv_slots))

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
                self.on_failure(what, err)
            raise
        finally:
            self.doing = None

    def close(self) -> None:
        """The followers drop their copy of this engine (its pool is freed on every rank). A
        no-op after a failure (the group is broken)."""
        if self.failure is None:
            broadcast(self.group, (CLOSE, self.channel))

    def stop(self, error: str | None = None) -> None:
        """:func:`release` the followers, unless a step failed (the group is broken; the
        followers learn of it by themselves)."""
        if self.failure is None:
            release(self.group, error)


def release(group: ParallelGroup, error: str | None = None) -> None:
    """The leader's last message: the followers return from :func:`follow`, or, given
    ``error`` (why the leader is stopping), raise :class:`RankFailure` with it."""
    broadcast(group, (STOP, error))


def _leading(runner: type[ModelRunner]) -> type[LeaderRunner]:
    """:class:`LeaderRunner` over ``runner``'s rotation and forward (itself for ModelRunner)."""
    if issubclass(runner, LeaderRunner):
        raise ValueError(f"{runner.__name__} already leads: pass the runner the ranks run")
    if runner is ModelRunner:
        return LeaderRunner
    return type(f"Leader{runner.__name__}", (LeaderRunner, runner), {})


def check_repair(cache: CacheConfig, world_size: int) -> None:
    """Refuse repair that does not run sharded: the signed rule scores reused tokens by the
    prompt tail's attention output, of which a rank computes only its own heads' share."""
    if world_size > 1 and cache.recompute_share and cache.recompute_rule == "signed":
        raise ValueError("--recompute-rule signed does not run under --tensor-parallel (each "
                         "rank holds only its heads' share of the attention output it scores "
                         "by); use --recompute-rule deviation")


def resolved(model: MLAModel, config: EngineConfig) -> EngineConfig:
    """``config`` with its kernels and graphs decided here, once for every rank (each rank's
    graphs hold collectives its peers' must meet): graphs only where asked for (True), since
    over several GPUs they have not run yet (an earlier attempt under a leader did not finish
    its test on two H200s, cause unknown: docs/multi-gpu.md)."""
    kernels, graphs = resolve_backend(model, config.kernels, config.graphs or False)
    return dataclasses.replace(config, kernels=kernels, graphs=graphs)


def leader_engine(model: MLAModel, config: EngineConfig, group: ParallelGroup, *,
                  runner: type[ModelRunner] = ModelRunner,
                  on_failure: Callable[[str, BaseException], None] | None = None,
                  timeout_s: float | None = None) -> Engine:
    """An engine of the leader's over its shard ``model`` (:func:`~.shard.shard_model`'s),
    opened on every rank: each follower builds the same engine (``config``, ``runner``'s class)
    and runs its steps; with CUDA graphs only where ``config`` asks for them (True; every rank
    captures its own). ``on_failure``: see
    :class:`LeaderRunner`; ``timeout_s``: how long the followers may take to be ready (their
    first engine waits for their loads). Its signature is :class:`~irminsul.engine.Engine`'s
    after ``group``, so it can stand where an engine is built (the gate, the server)."""
    if not group.leader:
        raise ValueError(f"rank {group.rank} is a follower: it runs follow(), not a leader")
    check_sharded(model, group)
    check_repair(config.cache, group.world_size)
    config = resolved(model, config)
    channel = next(_channels)
    broadcast(group, (OPEN, channel, config, runner), timeout_s=timeout_s)
    leading = _leading(runner)

    def make(*args: Any, **kwargs: Any) -> LeaderRunner:
        return leading(*args, group=group, channel=channel, on_failure=on_failure, **kwargs)

    return Engine(model, config, runner=make)


def follow(model: MLAModel, group: ParallelGroup) -> int:
    """A follower's life: build each engine the leader opens (over this rank's shard
    ``model``), run each rotation, forward, row write, recomputation and latent check the leader
    broadcasts on the engine it names (their results are the leader's), drop the engines it
    closes, until the leader stops; returns the forwards run. Raises
    :class:`RankFailure` if the leader stops with an error or a rank fails (the follower then
    exits; nothing is left to serve)."""
    if group.leader:
        raise ValueError("rank 0 leads: it runs the engine with leader_engine(), not follow()")
    check_sharded(model, group)
    runners: dict[int, ModelRunner] = {}
    mirrors: dict[int, KeyMirror] = {}
    forwards = 0
    while True:
        kind, *args = broadcast(group)
        if kind == OPEN:
            channel, config, runner = args
            # Only the runner is used: the pool and its accounting are the leader's decisions.
            engine = Engine(model, config, runner=runner)
            runners[channel], mirrors[channel] = engine.runner, KeyMirror()
            log.info("rank %d of %d: engine %d opened (%s, KV pool %d slots)", group.rank,
                     group.world_size, channel, runner.__name__, engine.pool.num_slots)
            del engine  # its runner holds the pool: a CLOSE frees it
        elif kind == ROTATE:
            channel, reuse = args
            runners[channel].rotate(reuse)
        elif kind == FORWARD:
            channel, message, all_logits = args
            runners[channel].forward(mirrors[channel].decode(message), all_logits=all_logits)
            forwards += 1
        elif kind == WRITE:
            channel, handles, ckv, kr = args
            runners[channel].write_rows(handles, ckv, kr)
        elif kind == RECOMPUTE:
            runners[args[0]].recompute(args[1])
        elif kind == CHECK:
            channel, prompt, positions, ckv_slots = args
            runners[channel].check_latent(prompt, positions, ckv_slots)
        elif kind == CLOSE:
            del runners[args[0]], mirrors[args[0]]
        elif kind == STOP:
            if args[0] is not None:
                raise RankFailure(f"rank {group.rank} of {group.world_size}: the leader "
                                  f"stopped: {args[0]}")
            return forwards
        else:
            raise RankFailure(f"rank {group.rank}: unknown message {kind!r} from the leader")
