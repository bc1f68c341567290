"""The follower processes of ``irminsul serve --tensor-parallel N``, seen from the leader: started,
polled for an early end, and never left behind.

Each follower is ``python -m irminsul.parallel.follower`` with its :class:`~.follower.FollowerSpec`
on its stdin; the leader holds the pipe open, so a follower outlives the leader's process by no
more than the moment its pipe takes to close. A follower that fails writes one line (what it was
doing, its error) to a report file in a directory of the leader's; :meth:`Followers.exited` hands
it back with the process's status.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .follower import FollowerSpec, write_spec

log = logging.getLogger(__name__)


def free_address() -> str:
    """Where rank 0 listens for the others: a loopback port nothing listens on now (the ranks
    of one server share a host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@dataclass(frozen=True)
class Exited:
    """A follower whose process has ended."""

    rank: int
    pid: int
    status: int  # the process's exit status; negative: the signal that killed it
    report: str  # the follower's own line on what failed ("" if it wrote none: killed, say)

    def __str__(self) -> str:
        if self.status < 0:
            try:
                how = f"was killed by {signal.Signals(-self.status).name}"
            except ValueError:
                how = f"was killed by signal {-self.status}"
        else:
            how = f"exited with status {self.status}"
        return f"rank {self.rank} (pid {self.pid}) {how}" + (f": {self.report}"
                                                              if self.report else "")


class Followers:
    """The leader's follower processes, by rank: ``python -m MODULE`` each (the tensor-parallel
    follower; under data-parallel attention, every rank's server, :mod:`.rank_server`)."""

    def __init__(self, module: str = "irminsul.parallel.follower") -> None:
        self.module = module
        self.directory = Path(tempfile.mkdtemp(prefix="irminsul-ranks-"))
        self.processes: dict[int, subprocess.Popen] = {}

    def report_path(self, rank: int) -> str:
        """Where rank ``rank`` writes why it failed (its spec's ``report``)."""
        return str(self.directory / f"rank-{rank}.txt")

    def start(self, spec: FollowerSpec) -> None:
        """Start the follower of ``spec`` and hand it its spec; it runs until stopped."""
        env = os.environ | {"RANK": str(spec.rank), "LOCAL_RANK": str(spec.rank),
                            "WORLD_SIZE": str(spec.parallel.world_size)}
        # A session of its own: a terminal's Ctrl-C (SIGINT to its foreground process group)
        # reaches this process alone, which stops the ranks in order; a rank never outlives it
        # anyway (its stdin pipe from here closes).
        process = subprocess.Popen([sys.executable, "-m", self.module],
                                   stdin=subprocess.PIPE, env=env, start_new_session=True)
        self.processes[spec.rank] = process
        write_spec(process.stdin, spec)
        log.info("%s parallel: rank %d of %d started (pid %d, %s)", spec.parallel.attention,
                 spec.rank, spec.parallel.world_size, process.pid, spec.config.device)

    def exited(self) -> list[Exited]:
        """The followers whose process has ended, by rank."""
        return [self._exited(rank, p) for rank, p in sorted(self.processes.items())
                if p.poll() is not None]

    def running(self) -> list[int]:
        """The ranks whose process is still running."""
        return [rank for rank, p in sorted(self.processes.items()) if p.poll() is None]

    def wait(self, timeout_s: float) -> bool:
        """Whether every follower has ended within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.running():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def kill(self) -> None:
        """Kill every follower still running (each by its own pid), and reap them."""
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
        for process in self.processes.values():
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Close the followers' pipes (a follower still running takes it as the leader's end
        and exits), kill what remains after a moment, and remove the report directory."""
        for process in self.processes.values():
            if process.stdin is not None:
                try:
                    process.stdin.close()
                except OSError:
                    pass
        if not self.wait(5.0):
            self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _exited(self, rank: int, process: subprocess.Popen) -> Exited:
        try:
            report = Path(self.report_path(rank)).read_text("utf-8").strip()
        except OSError:
            report = ""
        return Exited(rank, process.pid, process.returncode, report)
