"""A log's prompts, rendered in log order, by worker processes when the machine has cores to spare.

Rendering and tokenising is most of what ``analyze`` spends on a real log, and sessions render
independently: a request's render reuses only the renderer's memo of its own conversation. So each
of ``workers`` processes reads the whole log and parses and renders the lines of the sessions
assigned to it (by a stable hash of the session name, read from the raw line: a worker does not
parse the others' lines), so a conversation's memo stays in one process; the caller receives every
prompt in log order, merging the workers' streams by line number. Which process renders a request
changes nothing in its tokens: rendering is deterministic, the memo only saves work.

The workers are forked (the renderer is inherited, not pickled); where ``fork`` is unavailable, or
with one worker, rendering happens in the calling process.
"""

from __future__ import annotations

import heapq
import logging
import multiprocessing
import os
import re
import zlib
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait

import numpy as np

from ..traffic.logs import LogError, parse_line, read_lines, read_requests
from ..traffic.prompt import Prompt, render_prompt
from ..traffic.render import ChatRenderer, TemplateError
from .characterize import ROLES

BATCH = 16  # prompts per message from a worker
_ROLE_CODES = {role: code for code, role in enumerate(ROLES)}
# Lines a worker reads without one of its own before it tells the caller how far it got (the
# caller cannot hand on a line until every worker has read past it).
PROGRESS = 256
# The session's name on a raw line (a JSON string, escapes and all), found without parsing it.
_SESSION = re.compile(rb'"session"\s*:\s*("(?:[^"\\]|\\.)*")')


def default_workers() -> int:
    """Render processes: one per core, up to 4 (the analyses in the calling process take turns
    with them; rendering is the larger share of the work)."""
    return max(1, min(4, os.cpu_count() or 1))


def _render(renderer: ChatRenderer, request) -> tuple[Prompt, np.ndarray]:
    """A request's prompt and role codes; a LogError naming its line if it cannot be rendered
    (a field of a shape the template cannot take)."""
    try:
        prompt = render_prompt(renderer, request.messages, request.tools,
                               session=request.session)
    except TemplateError as err:
        raise LogError(request.source, f"cannot render the request: {err}") from None
    roles = np.fromiter(map(_ROLE_CODES.__getitem__, [m["role"] for m in request.messages]),
                        dtype=np.int8, count=len(request.messages))
    # The rendered request is dropped: the analyses need tokens, resets and roles only.
    return Prompt(prompt.session, prompt.tokens, prompt.message_starts, prompt.markers), roles


def _owner(raw: bytes, workers: int) -> int:
    """The worker that renders a raw log line: by its session's name, so that a conversation's
    memo stays in one process. Any rule that gives every line of a session the same worker
    would do (a line without a session is a session of its own: any worker)."""
    found = _SESSION.search(raw)
    return zlib.crc32(found.group(1) if found else raw) % workers


def _worker(path: str, renderer: ChatRenderer, strict: bool, worker: int, workers: int,
            conn: Connection) -> None:
    """Parse and render this worker's lines of the log. Sends ("lines", read up to, [(line,
    prompt, roles)], [(line, source, problem)] malformed), then ("done", stream error or None),
    or ("error", last line read, exception) and stops (strict: on its first malformed line, which
    is then the last read, or on a damaged stream). A LogError travels as its (source, problem):
    its constructor's arguments are not what pickling rebuilds it from."""
    batch: list[tuple[int, Prompt, np.ndarray]] = []
    errors: list[tuple[int, str, str]] = []
    line, told = 0, 0
    try:
        try:
            for line, raw in read_lines(path):
                if _owner(raw, workers) == worker:
                    try:
                        batch.append((line, *_render(renderer, parse_line(path, line, raw))))
                    except LogError as err:
                        if strict:
                            raise
                        errors.append((line, err.source, err.problem))
                if len(batch) == BATCH or line - told >= PROGRESS:
                    conn.send(("lines", line, batch, errors))
                    batch, errors, told = [], [], line
            stream = None
        except LogError as err:  # the compressed stream is damaged after ``line``
            if strict:
                raise
            stream = (err.source, err.problem) if worker == 0 else None  # every worker sees it
        conn.send(("lines", line, batch, errors))
        conn.send(("done", stream))
    except LogError as err:
        conn.send(("lines", line, batch, errors))  # the lines before it are the caller's
        conn.send(("error", line, (err.source, err.problem)))
    except BaseException as err:  # noqa: B036 (handed to the caller, which raises it)
        conn.send(("error", line, err))
    finally:
        conn.close()


def rendered_prompts(path: str | os.PathLike, renderer: ChatRenderer, *, strict: bool = False,
                     on_error: Callable[[LogError], None] | None = None,
                     workers: int = 1) -> Iterator[tuple[Prompt, np.ndarray]]:
    """Every request of a log as (prompt, role code of each message), in log order.

    Malformed lines go to ``on_error`` (or raise, with ``strict``) as in
    :func:`~irminsul.traffic.logs.read_requests`; with workers they are reported at the end."""
    path = os.fspath(path)
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for request in read_requests(path, strict=strict, on_error=on_error):
            try:
                rendered = _render(renderer, request)
            except LogError as err:
                if strict:
                    raise
                _report(err, on_error)
                continue
            yield rendered
        return
    context = multiprocessing.get_context("fork")
    conns, procs = [], []
    for worker in range(workers):
        receive, send = context.Pipe(duplex=False)
        proc = context.Process(target=_worker, args=(path, renderer, strict, worker, workers, send),
                               daemon=True)
        proc.start()
        send.close()
        conns.append(receive)
        procs.append(proc)
    read = dict.fromkeys(conns, 0)  # how far each worker still reading has got
    pending: list[tuple[int, Prompt, np.ndarray]] = []  # a heap by line
    errors: list[tuple[int, str, str]] = []
    stream: tuple[str, str] | None = None
    failure: tuple[int, BaseException] | None = None  # the first line a worker failed on
    try:
        while read:
            # Every line up to the least any worker still reading has got is here (or is none
            # of theirs): hand those on, in order, up to a line a worker failed on.
            horizon = min(read.values())
            if failure is not None:
                horizon = min(horizon, failure[0] - 1)
            while pending and pending[0][0] <= horizon:
                _, prompt, roles = heapq.heappop(pending)
                yield prompt, roles
            if failure is not None and horizon >= failure[0] - 1:
                break
            for conn in wait(list(read)):
                try:
                    message = conn.recv()
                except EOFError:
                    raise RuntimeError(f"{path}: a render worker stopped after line "
                                       f"{read[conn]}") from None
                if message[0] == "lines":
                    read[conn] = message[1]
                    for item in message[2]:
                        heapq.heappush(pending, item)
                    errors += message[3]
                elif message[0] == "done":
                    stream = stream or message[1]
                    del read[conn]
                else:  # strict: a malformed line, or the stream damaged, after line message[1]
                    line, err = message[1] + 1, message[2]
                    if not isinstance(err, tuple):
                        raise err
                    if failure is None or line < failure[0]:
                        failure = (line, LogError(*err))
                    del read[conn]
        if failure is not None:
            while pending and pending[0][0] < failure[0]:
                _, prompt, roles = heapq.heappop(pending)
                yield prompt, roles
            raise failure[1]
        while pending:
            _, prompt, roles = heapq.heappop(pending)
            yield prompt, roles
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
        for conn in conns:
            conn.close()
    found = [LogError(source, problem) for _, source, problem in sorted(errors)]
    for err in found + ([LogError(*stream)] if stream else []):
        _report(err, on_error)


def _report(err: LogError, on_error: Callable[[LogError], None] | None) -> None:
    """A malformed line to ``on_error``, or (None) a logging WARNING as read_requests does."""
    if on_error is not None:
        on_error(err)
    else:
        logging.getLogger(read_requests.__module__).warning("%s", err)
