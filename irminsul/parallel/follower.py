"""A follower rank of ``irminsul serve --tensor-parallel N``: its own process, started by the leader
(:mod:`.ranks`) as ``python -m irminsul.parallel.follower``.

The leader writes the rank's :class:`FollowerSpec` (pickled) to the follower's stdin and keeps the
pipe open for the follower's whole life: when the leader's process ends, however it ends (killed
included), the pipe closes and the follower exits at once: no orphans. The follower joins the
group, reads its share of the checkpoint, and follows the leader — builds each engine the leader
opens (the PIC gate's, then the serving one; their pools' sizes are the leader's decisions) and
runs its steps — until it is told to stop. If anything fails, it writes one line — what it was
doing and the error — to its ``report`` file for the leader's log, and exits with status 1.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypeVar

import torch

from ..config import ParallelConfig, ServerConfig

if TYPE_CHECKING:
    from .group import ParallelGroup

log = logging.getLogger("irminsul.parallel.follower")

STARTUP_TIMEOUT_S = 3600.0  # the leader's wait for the followers' loads (a large checkpoint's)


@dataclass(frozen=True)
class FollowerSpec:
    """What a follower needs to build its shard of the leader's model."""

    rank: int
    parallel: ParallelConfig
    address: str  # tcp://HOST:PORT, where rank 0 listens
    model_dir: str
    config: ServerConfig  # its device is this rank's
    threads: int  # torch's intra-op threads (the host's cores shared among the ranks)
    report: str  # a file: why this rank failed, one line, for the leader's log
    random_weights: str | None = None  # benchmark-only: the config.json of random weights
    vocab: int = 0  # random weights: the tokenizer's ids (the rows past them are zero)
    never: tuple[int, ...] = ()  # random weights: the stop tokens' ids (zero rows)


def write_spec(pipe: BinaryIO, spec: FollowerSpec) -> None:
    """The leader's side: the spec, length-prefixed, on the follower's stdin (left open)."""
    data = pickle.dumps(spec)
    pipe.write(len(data).to_bytes(8, "little") + data)
    pipe.flush()


def read_spec(pipe: BinaryIO) -> FollowerSpec:
    size = int.from_bytes(_read_exactly(pipe, 8), "little")
    return pickle.loads(_read_exactly(pipe, size))


def _read_exactly(pipe: BinaryIO, size: int) -> bytes:
    data = pipe.read(size)
    if data is None or len(data) != size:
        raise EOFError("the leader closed the pipe before sending this rank's spec")
    return data


class Follower:
    """One follower's life; :attr:`doing` says what it is doing, for its failure report."""

    def __init__(self, spec: FollowerSpec) -> None:
        self.spec = spec
        self.doing = "starting"
        self.stopping = False  # the leader said stop: its pipe closing is no longer a failure

    def run(self) -> int:
        """Join, load, shard, follow; returns the forwards run. Raises what failed."""
        from . import follow, shard_model

        spec = self.spec
        group, device = self._join()
        self.doing = "loading the checkpoint"
        model = self._load(device)
        self.doing = "sharding the model"
        shard_model(model, group)
        log.info("rank %d of %d following the leader (%s)", spec.rank,
                 spec.parallel.world_size, device)
        # The engines (the PIC gate's, then the serving one) are the leader's to open.
        self.doing = "following the leader's steps"
        forwards = follow(model, group)
        self.stopping = True
        return forwards

    def _join(self) -> tuple[ParallelGroup, str]:
        """Take this rank's device and join the group: (the group, the device)."""
        from .group import init

        device = self.spec.config.device or "cpu"
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(device))
        self.doing = "joining the process group"
        return init(self.spec.rank, self.spec.parallel, self.spec.address, device=device), device

    def _load(self, device: str) -> torch.nn.Module:
        spec = self.spec
        dtype = spec.config.dtype
        dtype = getattr(torch, dtype if dtype != "auto" else (
            "bfloat16" if device.startswith("cuda") else "float32"))
        if spec.random_weights is not None:
            from ..server.launch import random_model  # the web stack loads only for this

            return random_model(spec.random_weights, vocab=spec.vocab, device=device,
                                dtype=dtype, never=spec.never, keep_fp8=spec.config.keep_fp8,
                                share=(spec.rank, spec.parallel.world_size),
                                attention=spec.parallel.attention)
        from .load import load_shard  # this rank's share only: no rank holds the whole model

        return load_shard(spec.model_dir, spec.rank, spec.parallel.world_size, dtype=dtype,
                          device=device, keep_fp8=spec.config.keep_fp8,
                          attention=spec.parallel.attention)

    def fail(self, err: BaseException) -> None:
        """Report ``err`` (log and report file) and end the process (``parallel.abort``)."""
        from .group import RankFailure, abort

        line = (f"rank {self.spec.rank} failed while {self.doing}: "
                f"{type(err).__name__}: {err}")
        # A rank's failure says all there is to say; anything else is a bug: its traceback
        log.error("%s", line, exc_info=not isinstance(err, (RankFailure, KeyboardInterrupt)))
        try:
            Path(self.spec.report).write_text(line + "\n", encoding="utf-8")
        except OSError:
            pass
        abort(1)


def _exit_with_the_leader(follower: Follower, pipe: BinaryIO) -> None:
    """Block on the leader's pipe; its end (the leader's process ended) ends this one."""
    try:
        while pipe.read(1 << 16):
            pass
    except (OSError, ValueError):
        pass
    if not follower.stopping:
        log.error("the leader's process ended while this rank was %s; exiting",
                  follower.doing)
        sys.stderr.flush()
        os._exit(1)


F = TypeVar("F", bound=Follower)


def started(kind: type[F]) -> F:
    """A rank process's start: its spec read from stdin, logging and threads set, and a thread
    that ends the process when the process that started it ends (its pipe closes)."""
    spec = read_spec(sys.stdin.buffer)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(levelname)s irminsul rank {spec.rank}: %(message)s")
    torch.set_num_threads(spec.threads)
    rank = kind(spec)
    threading.Thread(target=_exit_with_the_leader, args=(rank, sys.stdin.buffer),
                     name="irminsul-leader-pipe", daemon=True).start()
    return rank


def main() -> None:
    """The process: read the spec from stdin, then run the follower until the leader stops."""
    # A stop is the leader's to make: a terminal's Ctrl-C or systemd's SIGTERM reaches every
    # process, and a follower ending on it would end mid-broadcast. It ends when the leader
    # releases it, or when the leader's process ends (its pipe closes).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    follower = started(Follower)
    try:
        forwards = follower.run()
    except BaseException as err:  # every failure is reported, then the process ends
        follower.fail(err)
    from .group import shutdown

    shutdown()
    log.info("stopped by the leader after %d forwards", forwards)
    # Not an interpreter exit: the thread reading the leader's pipe would block it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
