"""``irminsul analyze``: characterisation, recoverability and serve-path replay of request logs."""

from __future__ import annotations

import os
import time

from tqdm import tqdm

from ..config import REPLAY_CAPACITY
from ..traffic.logs import LogError
from ..traffic.render import ChatRenderer
from .characterize import Characterisation
from .offload import offload
from .prompts import default_workers, rendered_prompts
from .recoverability import Recoverability
from .replay import Replay


def analyze_log(path: str | os.PathLike, renderer: ChatRenderer, *,
                capacity: int | None = REPLAY_CAPACITY, strict: bool = False,
                progress: bool = True, workers: int | None = None) -> dict:
    """Run the three analyses over one log, streaming it once in order; returns the JSON report.

    ``workers``: processes rendering the log's prompts (None: one per core, see
    :func:`~irminsul.analysis.prompts.default_workers`; 1: everything in this process). With
    more than one, the replay also runs in a process of its own, beside the other two passes."""
    workers = default_workers() if workers is None else workers
    # Forked before the render workers start (and before any thread: the queue's feeder starts
    # with the first prompt).
    replay = offload(lambda: Replay(capacity), fork=workers > 1)
    characterisation, recoverability = Characterisation(), Recoverability()
    errors: list[LogError] = []
    requests = marked = tokens = 0
    started = time.perf_counter()
    bar = tqdm(desc=os.path.basename(path), unit=" req", disable=not progress, leave=False)
    try:
        for prompt, roles in rendered_prompts(path, renderer, strict=strict,
                                              on_error=errors.append, workers=workers):
            marked += bool(prompt.markers.size)
            prefix = characterisation.add(prompt, roles)
            recoverability.add(prompt, prefix)
            replay.add(prompt)
            requests += 1
            tokens += prompt.size
            bar.update()
            bar.set_postfix_str(f"{tokens / 1e6:.1f}M tok", refresh=False)
        replayed = replay.result()
    except BaseException:
        replay.close()
        raise
    bar.close()
    return {
        "log": str(path),
        "requests": requests,
        "prompt_tokens": tokens,
        "malformed_lines": [str(e) for e in errors],
        "requests_with_markers": marked,
        "tokenizer": renderer.name,
        "seconds": round(time.perf_counter() - started, 2),
        "characterisation": characterisation.result(),
        "recoverability": recoverability.result(),
        "replay": replayed,
    }
