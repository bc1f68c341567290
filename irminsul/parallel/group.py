"""The process group: one process per GPU, every rank running the same model runner on its shard.

Two groups over the same ranks. The *device* group carries the forward's all-reduces (NCCL on
GPUs, gloo on CPUs) and fails a collective that waits longer than ``ParallelConfig.timeout_s``.
The *control* group (always gloo: it moves pickled host objects) carries the leader's one
message per step to the followers; a follower waits on it for as long as the server is idle, the
leader's sends fail after the timeout. A peer that dies closes its connections, which fails a
collective waiting on it in either group at once; a peer that hangs fails the others' next
collective with it after the timeout. Either way the survivors raise :class:`RankFailure`, naming the
rank and what it was doing, rather than hang.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..config import ParallelConfig

# The control group's wait for the leader's next step: the server may be idle for days.
CONTROL_TIMEOUT = timedelta(days=365)
# How long the ranks may take to meet at ``address`` (each starts an interpreter, imports torch,
# initialises its device): not the collective timeout, which is for a peer that hangs. A rank
# that dies before it joins is seen by the process that started it.
JOIN_TIMEOUT = timedelta(minutes=10)


class RankFailure(RuntimeError):
    """A collective failed: a peer rank died, raised or stopped answering. The group cannot be
    used after it; the process stops serving."""


@dataclass(frozen=True)
class ParallelGroup:
    """This process's place among the ranks and the two groups it talks over."""

    rank: int
    world_size: int
    device_group: dist.ProcessGroup  # the forward's all-reduces
    control_group: dist.ProcessGroup  # the leader's per-step messages (gloo, host objects)
    timeout_s: float

    @property
    def leader(self) -> bool:
        """Rank 0 runs the scheduler and the cache manager; the others follow it."""
        return self.rank == 0


def init(rank: int, config: ParallelConfig, address: str, *,
         device: torch.device | str = "cpu") -> ParallelGroup:
    """Join the group of ``config.world_size`` ranks at ``address`` (``tcp://HOST:PORT``; rank
    0 listens there) as ``rank``; every rank calls this. The backend is ``config.backend``, or
    NCCL when ``device`` is CUDA and gloo otherwise."""
    if not 0 <= rank < config.world_size:
        raise ValueError(f"rank {rank} is not in a world of {config.world_size}")
    device = torch.device(device)
    backend = config.backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = timedelta(seconds=config.timeout_s)
    # The rendezvous's own store: init_process_group's tcp:// rendezvous would wait only
    # ``timeout`` for every rank to arrive.
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), config.world_size, is_master=rank == 0,
                          timeout=max(JOIN_TIMEOUT, timeout))
    dist.init_process_group(backend, store=store, rank=rank,
                            world_size=config.world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return ParallelGroup(rank, config.world_size, dist.group.WORLD, control, config.timeout_s)


def shutdown() -> None:
    """Leave the group (after the last collective; a no-op where none was joined). Not after a
    :class:`RankFailure`: that process ends with :func:`abort`."""
    if dist.is_initialized():
        dist.destroy_process_group()


def abort(code: int = 1) -> NoReturn:
    """End this process at once, after a :class:`RankFailure` has been reported: tearing the
    group down, or even an orderly interpreter exit, waits for the failed operation's peer,
    which may never answer."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextmanager
def guarded(group: ParallelGroup, what: str) -> Iterator[None]:
    """Turn a backend's error inside the block (gloo's closed connection or timeout, NCCL's
    DistBackendError) into a :class:`RankFailure` that says which rank saw it and why."""
    try:
        yield
    except RuntimeError as err:
        raise RankFailure(f"rank {group.rank} of {group.world_size}: {what} failed: a peer "
                          f"rank stopped, or did not answer within {group.timeout_s:g} s "
                          f"({type(err).__name__}: {err})") from err


def all_reduce(group: ParallelGroup, partial: torch.Tensor) -> torch.Tensor:
    """The sum of ``partial`` over the ranks, in place. Every rank gets the same bits (gloo's,
    tested; NCCL's ring and tree algorithms likewise reduce each element once, then copy it),
    so the ranks' replicated state (hidden states, router choices, latent rows) never drifts."""
    with guarded(group, "an all-reduce"):
        dist.all_reduce(partial, group=group.device_group)
    return partial


def broadcast(group: ParallelGroup, message: Any = None, *, timeout_s: float | None = None) -> Any:
    """The leader's ``message`` on every rank (pickled, over the control group); followers pass
    nothing and get it. A follower waits for it as long as it takes (the server may be idle);
    the leader's send fails after ``timeout_s`` (default: the group's; gloo sends only once the
    receiver has posted its receive, so a hung follower would otherwise block the leader for
    good)."""
    wait = (timedelta(seconds=timeout_s or group.timeout_s) if group.leader
            else CONTROL_TIMEOUT)
    what = "sending a step to the followers" if group.leader else "waiting for the leader's step"
    with guarded(group, what):
        if group.leader:
            payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=group.control_group, async_op=True).wait(wait)
        if not group.leader:
            payload = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=group.control_group, async_op=True).wait(wait)
    return message if group.leader else pickle.loads(payload.numpy().tobytes())
