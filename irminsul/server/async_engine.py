"""The scheduler's step loop on one background thread, fed and drained from asyncio.

The model, the KV pool and the cache indexes are not thread-safe, so exactly one thread — the
engine thread — ever touches the :class:`Scheduler`. Everything else talks to it through a
thread-safe command queue (add, abort, run-a-function, stop), and it answers through
``loop.call_soon_threadsafe`` into each request's own ``asyncio.Queue``. One step's outputs are
delivered in one callback per event loop, so a busy batch costs the loop one wake-up per step,
not one per request.

A request that fails to be admitted (a prompt that can never fit) gets the scheduler's
ValueError from :meth:`AsyncEngine.submit`; a request the scheduler fails on its own (an error
while planning, computing or sampling it) raises EngineError in its consumer alone; a step that
raises as a whole fails only the requests that were running (their slots are freed) and the loop
keeps serving. A handle dropped by its consumer
(a client gone, a stop string seen) is aborted, which frees its slots at the next loop turn.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..engine import Limits, SamplingParams, Scheduler, StepOutput

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineError(RuntimeError):
    """The engine failed while serving a request, or is shut down."""


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's load after its latest loop turn, published for readers on other threads
    (the metrics endpoint) as one immutable object, so they never see a half-updated state."""

    running: int = 0
    waiting: int = 0
    pool_capacity: int = 0
    pool_free: int = 0
    steps: int = 0
    step_errors: int = 0
    graph_replays: int = 0  # forwards replayed from a CUDA graph
    request_failures: int = 0  # requests the engine failed alone (the others went on)
    healed_tokens: int = 0  # rows recomputed by heals (CacheConfig.heal)
    # aborts applied: each may change the cache indexes between steps (a request remembered)
    aborts: int = 0
    # idle work run (an audit, a heal's forward): each may change the cache indexes too (an
    # audit's recomputation evicts to make room)
    idle_runs: int = 0

    @property
    def pool_usage(self) -> float:
        """Share of KV slots referenced by anything: requests, the radix tree, the registry."""
        if not self.pool_capacity:
            return 0.0
        return 1.0 - self.pool_free / self.pool_capacity


class RequestHandle:
    """One submitted request, seen from asyncio: an async iterator of its StepOutputs.

    Iteration ends after the output marked ``finished`` (a stop token, the length limit, or the
    abort of this handle); an engine failure is raised from the iteration as EngineError.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop,
                 prompt_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self._done = False
        self._abort_sent = False

    @property
    def done(self) -> bool:
        """Whether the final output (or an error) has been consumed, or an abort was asked."""
        return self._done or self._abort_sent

    def abort(self, reason: str = "abort") -> None:
        """Stop the request and free its slots; idempotent, callable from a ``finally``."""
        if self._done or self._abort_sent:
            return
        self._abort_sent = True
        self._engine._send(_Abort(self.request_id, reason))

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> StepOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def _deliver(self, item: StepOutput | BaseException) -> None:
        """Called on this handle's event loop only."""
        self._queue.put_nowait(item)


# -- commands to the engine thread -----------------------------------------------------------------

@dataclass
class _Add:
    handle: RequestHandle
    prompt: list[int]
    params: SamplingParams
    resets: tuple[int, ...]
    namespace: int
    admitted: asyncio.Future  # resolved on the handle's loop: None, or the ValueError


@dataclass
class _Abort:
    request_id: str
    reason: str


@dataclass
class _Call:
    fn: Callable[[Scheduler], Any]
    future: concurrent.futures.Future


_STOP = object()
# Under data-parallel attention, an idle engine's wait for a command between its turns while no
# rank runs anything: what a new request on another rank may wait for this one's turn. It
# doubles with each turn in which no rank ran anything, from the first to the second figure: an
# idle server takes ~50 turns a second, not 500 (on two CPU cores, a rank's turns at 2 ms cost
# ~30% of a core), and a busy one answers its peers at once.
PEER_PAUSE_S = (0.002, 0.02)


class AsyncEngine:
    """Owns the engine thread; asyncio code submits requests and iterates their outputs."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler  # the engine thread's alone once started
        self.limits: Limits = scheduler.limits  # immutable: readable from any thread
        self.snapshot = EngineSnapshot()
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._closed = False
        # Set under _send_lock once the engine thread has answered its last command: a command
        # sent after that (a submit that saw the engine alive just before it stopped) is
        # refused by its sender, which would otherwise wait for an answer forever.
        self._send_lock = threading.Lock()
        self._drained = False
        self._steps = self._errors = self._aborts = self._idle_runs = 0
        # Data-parallel attention: the ranks whose steps this engine must take turns in when it
        # has nothing to run; whether one ran a step in the last turn.
        self._peers = scheduler.engine.peers
        self._peers_busy = False
        self._peer_pause = PEER_PAUSE_S[0]
        self._publish()

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._closed:
            raise EngineError("engine is shut down")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="irminsul-engine", daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` for the engine thread to end (after :meth:`shutdown`); True
        when it is not running. Unlike :attr:`alive`, False while a step is still in flight
        after shutdown was asked."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Abort whatever is in flight (waiters get EngineError) and stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the asyncio side --------------------------------------------------------------------------

    async def submit(self, prompt: Iterable[int], params: SamplingParams, *,
                     resets: Iterable[int] = (), namespace: int = 0,
                     request_id: str | None = None) -> RequestHandle:
        """Queue a request; returns its handle once the scheduler has accepted it. Raises the
        scheduler's ValueError for a prompt that can never run (too long for the context or the
        KV pool), and EngineError when the engine is not running."""
        if not self.alive:
            raise EngineError("engine is not running")
        loop = asyncio.get_running_loop()
        prompt = [int(t) for t in prompt]
        handle = RequestHandle(self, request_id or f"req-{uuid.uuid4().hex}", loop, len(prompt))
        admitted = loop.create_future()
        self._send(_Add(handle, prompt, params, tuple(int(r) for r in resets), namespace,
                        admitted))
        try:
            await admitted
        except asyncio.CancelledError:
            handle.abort()  # queued after the add, so the engine thread sees them in order
            raise
        return handle

    async def generate(self, prompt: Iterable[int], params: SamplingParams, *,
                       resets: Iterable[int] = (), namespace: int = 0,
                       request_id: str | None = None) -> AsyncIterator[StepOutput]:
        """Submit and yield the request's outputs; leaving early (break, cancellation, a
        disconnected client) aborts it."""
        handle = await self.submit(prompt, params, resets=resets, namespace=namespace,
                                   request_id=request_id)
        try:
            async for out in handle:
                yield out
        finally:
            handle.abort()

    def run_in_engine_thread(self, fn: Callable[[Scheduler], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(scheduler)`` on the engine thread between steps (inspection, ``check()``);
        wrap the future with ``asyncio.wrap_future`` to await it."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(EngineError("engine is not running"))
        else:
            self._send(_Call(fn, future))
        return future

    def _send(self, command: Any) -> None:
        with self._send_lock:
            if not self._drained:
                self._commands.put(command)
                return
        self._refuse(command)

    # -- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if not self._take_commands():
                    self._peer_turn(stop=True)  # every rank stops after this turn
                    break
                if self.scheduler.has_work():
                    turns = self._peers.turns if self._peers is not None else 0
                    self._step()
                    if self._peers is not None and self._peers.turns == turns:
                        # A step without a model call (admission blocked, a request awaiting
                        # content): the peers still need this rank's turn.
                        self._peer_turn()
                else:  # idle: an audit recomputation or a heal's forward, if any
                    if self.scheduler.run_idle():
                        self._idle_runs += 1
                    self._peer_turn()
                self._publish()
                if self._peers is not None and self._peers.stopped:
                    log.info("another rank stopped: this rank's engine stops too")
                    self._closed = True
                    break
        except BaseException as err:  # a bug in this loop itself: fail everyone, stop serving
            log.exception("engine thread crashed")
            self._closed = True
            self._fail_all(EngineError(f"engine thread crashed: {err}"))
            raise
        self._fail_all(EngineError("server is shutting down"))
        self._publish()

    def _peer_turn(self, stop: bool = False) -> None:
        """Under data-parallel attention, a turn in whatever step the peers take (``stop``: and
        announce this rank's stop); the wait before the next one doubles while none of them
        runs anything. Nothing without peers, or once a rank has stopped."""
        if self._peers is None or self._peers.stopped:
            return
        self._peers_busy = self._peers.idle(stop=stop)
        self._peer_pause = (PEER_PAUSE_S[0] if self._peers_busy else
                            min(2 * self._peer_pause, PEER_PAUSE_S[1]))

    def _take_commands(self) -> bool:
        """Apply queued commands; block for one only when idle. False once told to stop."""
        commands: list[Any] = []
        idle = self.scheduler.idle_wait()  # None with work, or nothing idle to do
        if self._peers is not None:  # never wait long: the peers' steps need this rank's turns
            idle = 0.0 if self._peers_busy else min(
                idle if idle is not None else self._peer_pause, self._peer_pause)
        if not self.scheduler.has_work():
            if idle != 0.0:
                try:  # nothing to do, or idle work not due yet: wait for a command that long
                    commands.append(self._commands.get(timeout=idle))
                except queue.Empty:
                    pass
        elif not self.scheduler.running:
            # Work is waiting but nothing runs (admission is blocked): don't spin on step().
            try:
                commands.append(self._commands.get(timeout=0.005))
            except queue.Empty:
                pass
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for i, command in enumerate(commands):
            if command is _STOP:
                for later in commands[i + 1:]:
                    self._refuse(later)
                return False
            self._apply(command)
        return True

    def _apply(self, command: Any) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            self._abort(command.request_id, command.reason)
        elif isinstance(command, _Call):
            if command.future.set_running_or_notify_cancel():
                try:
                    command.future.set_result(command.fn(self.scheduler))
                except BaseException as err:
                    command.future.set_exception(err)

    def _add(self, command: _Add) -> None:
        handle = command.handle
        error: BaseException | None = None
        if handle.request_id in self._handles:
            error = ValueError(f"request id {handle.request_id!r} is already in flight")
        else:
            try:
                self.scheduler.add(command.prompt, command.params, resets=command.resets,
                                   namespace=command.namespace, request_id=handle.request_id)
                self._handles[handle.request_id] = handle
            except Exception as err:  # ValueError: the prompt can never run
                error = err
        _resolve_threadsafe(handle._loop, command.admitted, error)

    def _abort(self, request_id: str, reason: str) -> None:
        self._aborts += 1
        handle = self._handles.pop(request_id, None)
        item: StepOutput | BaseException = StepOutput(request_id, [], True, reason, None, None)
        try:
            self.scheduler.abort(request_id, reason)
        except Exception as err:
            log.exception("abort of %s failed", request_id)
            self.scheduler.drop(request_id)
            item = EngineError(f"abort failed: {err!r}")
        if handle is not None:
            # Wake a consumer still waiting on the handle (a disconnect watcher aborted for it).
            self._post([(handle, item)])

    def _step(self) -> None:
        try:
            outputs = self.scheduler.step()
        except Exception as err:
            self._errors += 1
            log.exception("engine step failed; failing the running requests")
            self._fail_running(err)
            return
        self._steps += 1
        deliveries = []
        for out in outputs:
            handle = (self._handles.pop(out.request_id, None) if out.finished
                      else self._handles.get(out.request_id))
            if handle is not None:
                deliveries.append((handle, out if out.error is None else
                                   EngineError(f"request failed: {out.error}")))
        self._post(deliveries)

    def _fail_running(self, err: Exception) -> None:
        """A step raised: the batch's requests are lost. Abort them (freeing their slots, and
        keeping none of their rows: the step may have stopped before writing some) and tell
        their consumers; waiting requests were untouched and keep their turn."""
        for request in list(self.scheduler.running):
            try:
                self.scheduler.abort(request.id, "error", remember=False)
            except Exception:
                log.exception("abort of %s after a failed step failed", request.id)
                self.scheduler.drop(request.id)
        # Every consumer but the waiting requests': the running ones, and those the step
        # finished before it raised (they left the queues; their outputs went with the step).
        queued = {r.id for r in self.scheduler.waiting}
        failed = [i for i in self._handles if i not in queued]
        self._post([(self._handles.pop(i), EngineError(f"engine step failed: {err!r}"))
                    for i in failed])

    def _drain_after_stop(self) -> None:
        """Answer what arrived with or after the stop command, so no caller waits forever (what
        is sent after this, :meth:`_send` refuses itself)."""
        with self._send_lock:
            self._drained = True
        while True:
            try:
                self._refuse(self._commands.get_nowait())
            except queue.Empty:
                return

    def _refuse(self, command: Any) -> None:
        if isinstance(command, _Add):
            _resolve_threadsafe(command.handle._loop, command.admitted,
                                EngineError("server is shutting down"))
        elif isinstance(command, _Call) and command.future.set_running_or_notify_cancel():
            command.future.set_exception(EngineError("server is shutting down"))
        # aborts need no answer: _fail_all aborts everything in flight

    def _fail_all(self, err: EngineError) -> None:
        """Abort every request in flight and raise ``err`` in their consumers."""
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            try:
                self.scheduler.abort(request.id, "abort")
            except Exception:
                log.exception("abort of %s at shutdown failed", request.id)
        handles, self._handles = list(self._handles.values()), {}
        self._post([(handle, err) for handle in handles])
        self._drain_after_stop()

    def _post(self, deliveries: list[tuple[RequestHandle, StepOutput | BaseException]]) -> None:
        """Hand outputs to their event loops: one callback per loop per call."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for handle, item in deliveries:
            by_loop[handle._loop].append((handle, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                pass

    def _publish(self) -> None:
        load = self.scheduler.load()
        self.snapshot = EngineSnapshot(load.running, load.waiting, load.pool_capacity,
                                       load.pool_free, self._steps, self._errors,
                                       load.graph_replays, load.failed, load.healed_tokens,
                                       self._aborts, self._idle_runs)


def _deliver_all(items: list[tuple[RequestHandle, StepOutput | BaseException]]) -> None:
    for handle, item in items:
        handle._deliver(item)


def _resolve_threadsafe(loop: asyncio.AbstractEventLoop, future: asyncio.Future,
                        error: BaseException | None) -> None:
    """Settle an asyncio future from the engine thread (unless its waiter was cancelled)."""

    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass
