"""A log's prompts, rendered in log order, by worker processes when the machine has cores to spare.

Rendering and tokenising is most of what ``analyze`` spends on a real log, and sessions render
independently: a request's render reuses only the renderer's memo of its own conversation. So each
of ``workers`` processes reads the whole log and renders the requests of the sessions assigned to
it (by a stable hash of the session name, so a conversation's memo stays in one process); the
caller receives every prompt in log order. Which process renders a request changes nothing in its
tokens: rendering is deterministic, the memo only saves work.

The workers are forked (the renderer is inherited, not pickled); where ``fork`` is unavailable, or
with one worker, rendering happens in the calling process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import zlib
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait

import numpy as np

from ..traffic.logs import LogError, read_requests
from ..traffic.prompt import Prompt, render_prompt
from ..traffic.render import ChatRenderer
from .characterize import ROLES

BATCH = 16  # prompts per message from a worker


def default_workers() -> int:
    """Render processes: one per core, up to 4 (the analyses in the calling process take turns
    with them; rendering is the larger share of the work)."""
    return max(1, min(4, os.cpu_count() or 1))


def _render(renderer: ChatRenderer, request) -> tuple[Prompt, np.ndarray]:
    prompt = render_prompt(renderer, request.messages, request.tools, session=request.session)
    roles = np.fromiter((ROLES.index(m["role"]) for m in request.messages), dtype=np.int8,
                        count=len(request.messages))
    # The rendered request is dropped: the analyses need tokens, resets and roles only.
    return Prompt(prompt.session, prompt.tokens, prompt.message_starts, prompt.markers), roles


def _owner(session: str, workers: int) -> int:
    return zlib.crc32(session.encode("utf-8", "surrogatepass")) % workers


def _worker(path: str, renderer: ChatRenderer, strict: bool, worker: int, workers: int,
            conn: Connection) -> None:
    """Render this worker's share of the log; send (index, prompt, roles) batches, then
    ("done", requests, errors) or ("error", exception). A LogError travels as its (source,
    problem): its constructor's arguments are not what pickling rebuilds it from."""
    errors: list[tuple[str, str]] = []
    index, batch = 0, []
    try:
        for request in read_requests(path, strict=strict,
                                     on_error=lambda e: errors.append((e.source, e.problem))):
            if _owner(request.session, workers) == worker:
                batch.append((index, *_render(renderer, request)))
                if len(batch) == BATCH:
                    conn.send(batch)
                    batch = []
            index += 1
        conn.send(batch)
        conn.send(("done", index, errors if worker == 0 else []))
    except LogError as err:
        conn.send(("error", (err.source, err.problem)))
    except BaseException as err:  # noqa: B036 (handed to the caller, which raises it)
        conn.send(("error", err))
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
            yield _render(renderer, request)
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
    pending: dict[int, tuple[Prompt, np.ndarray]] = {}
    total, errors, following = None, [], 0
    try:
        open_conns = list(conns)
        while True:  # until every worker is done (the first reports the malformed lines)
            if following in pending:
                yield pending.pop(following)
                following += 1
                continue
            if not open_conns:
                if total is not None and following >= total:
                    break
                raise RuntimeError(f"{path}: a render worker stopped before request {following}")
            for conn in wait(open_conns):
                try:
                    message = conn.recv()
                except EOFError:
                    open_conns.remove(conn)
                    continue
                if isinstance(message, list):
                    pending.update((i, (prompt, roles)) for i, prompt, roles in message)
                elif message[0] == "done":
                    total = message[1]
                    errors += [LogError(*error) for error in message[2]]
                    open_conns.remove(conn)
                elif isinstance(message[1], tuple):
                    raise LogError(*message[1])
                else:
                    raise message[1]
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
        for conn in conns:
            conn.close()
    for err in errors:
        if on_error is not None:
            on_error(err)
        else:
            logging.getLogger(read_requests.__module__).warning("%s", err)
