"""One streaming pass of ``analyze`` run in a forked process, fed the prompts in order.

``analyze``'s passes read the same prompts in log order and share no state but the prompts (the
replay keeps its own radix tree). On a machine with cores to spare, the replay runs beside the
other two: the calling process puts each prompt on a queue (a feeder thread pickles and sends it
in the background, so the caller goes on with its own passes), and the child adds it to its own
copy of the pass. The result comes back when the caller asks for it. Order and content are those
of the in-process pass, so the result is the same.

The child is forked (the pass's factory is inherited, not pickled); where ``fork`` is unavailable,
the pass simply runs in the calling process.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Callable
from typing import Any, Protocol

BATCH = 32  # prompts per queue item: fewer, larger messages
DEPTH = 64  # queued batches at most (~2K prompts), so a slow child bounds the caller's memory
POLL_S = 1.0  # how often a caller blocked on the queue checks that the child still runs


class Pass(Protocol):
    """What :func:`offload` runs: ``add`` each prompt in order, then ``result``."""

    def add(self, prompt: Any) -> None: ...

    def result(self) -> dict: ...


class _Forked:
    """The calling side of a pass running in a child process."""

    def __init__(self, make: Callable[[], Pass]) -> None:
        context = multiprocessing.get_context("fork")
        self._queue = context.Queue(DEPTH)
        self._results = context.Queue(1)
        self._proc = context.Process(target=_child, args=(make, self._queue, self._results),
                                     daemon=True)
        self._proc.start()
        self._batch: list = []

    def add(self, prompt: Any) -> None:
        self._batch.append(prompt)
        if len(self._batch) == BATCH:
            self._put(self._batch)
            self._batch = []

    def result(self) -> dict:
        self._put(self._batch)
        self._put(None)
        try:
            while True:
                try:
                    status, value = self._results.get(timeout=POLL_S)
                    break
                except queue.Empty:
                    self._check()
        finally:
            self._queue.close()
            self._proc.join(timeout=POLL_S)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        """Stop the child without its result (the caller failed)."""
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()
        self._queue.cancel_join_thread()  # prompts still queued are dropped, not flushed
        self._queue.close()

    def _put(self, item: list | None) -> None:
        while True:
            try:
                self._queue.put(item, timeout=POLL_S)
                return
            except queue.Full:
                self._check()

    def _check(self) -> None:
        if not self._proc.is_alive():
            # An error the child reported comes first; otherwise it died without a word.
            try:
                status, value = self._results.get_nowait()
            except queue.Empty:
                raise RuntimeError(f"an analysis process exited with code "
                                   f"{self._proc.exitcode}") from None
            if status == "error":
                raise value
            raise RuntimeError("an analysis process ended before its input did")


def _child(make: Callable[[], Pass], prompts: Any, results: Any) -> None:
    try:
        work = make()
        while (batch := prompts.get()) is not None:
            for prompt in batch:
                work.add(prompt)
        results.put(("done", work.result()))
    except BaseException as err:  # noqa: B036 (handed to the caller, which raises it)
        results.put(("error", err))


class _InProcess:
    """The same interface, the pass run right here."""

    def __init__(self, make: Callable[[], Pass]) -> None:
        self._work = make()

    def add(self, prompt: Any) -> None:
        self._work.add(prompt)

    def result(self) -> dict:
        return self._work.result()

    def close(self) -> None:
        pass


def offload(make: Callable[[], Pass], *, fork: bool) -> _Forked | _InProcess:
    """The pass ``make()`` builds, in a forked child when ``fork`` (and the platform can fork),
    else in this process. Call ``add`` for every prompt in order, then ``result`` once; ``close``
    when giving up before the result."""
    if fork and "fork" in multiprocessing.get_all_start_methods():
        return _Forked(make)
    return _InProcess(make)
