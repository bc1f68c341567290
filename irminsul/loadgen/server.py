"""``irminsul serve`` started as a subprocess on a free loopback port, for one replay.

Its log goes to a file (shown in the error if it fails to start); it is ready when ``/health``
answers 200, and stopped with SIGINT (uvicorn's graceful shutdown), killed if it lingers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from .. import __version__

STARTUP_TIMEOUT_S = 900.0  # random weights of a large config and CUDA graph capture take minutes
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Served:
    """A running server: its base URL and the line it logged at start."""

    url: str
    startup_line: str


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path, lines: int = 30) -> str:
    text = log.read_text("utf-8", "replace").splitlines() if log.is_file() else []
    return "\n".join(text[-lines:])


def _startup_line(log: Path) -> str:
    marker = f"irminsul {__version__}: serving "
    for line in log.read_text("utf-8", "replace").splitlines():
        if marker in line:
            return line[line.index(marker):]
    return ""


class ServerError(RuntimeError):
    """The server did not start (the message ends with its log's last lines) or failed the
    warm-up."""


@contextlib.contextmanager
def spawn_server(serve_args: Sequence[str], log: Path, *,
                 timeout: float = STARTUP_TIMEOUT_S) -> Iterator[Served]:
    """Run ``irminsul serve SERVE_ARGS --host 127.0.0.1 --port P`` until the block ends."""
    port = free_port()
    command = [sys.executable, "-m", "irminsul.cli", "serve", *serve_args,
               "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env=os.environ | {"PYTHONUNBUFFERED": "1"})
    try:
        _wait_ready(process, url, log, timeout)
        yield Served(url, _startup_line(log))
    finally:
        _stop(process)


def _wait_ready(process: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False, timeout=5.0) as client:
        while True:
            if process.poll() is not None:
                raise ServerError(f"irminsul serve exited with status {process.returncode} "
                                   f"before it was ready; its log ends:\n{_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise ServerError(f"irminsul serve was not ready after {timeout:.0f} s; its log "
                                  f"ends:\n{_tail(log)}")
            time.sleep(0.2)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
