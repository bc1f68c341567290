"""``irminsul analyze``: characterisation, recoverability and serve-path replay of request logs."""

from __future__ import annotations

import os
import time

from tqdm import tqdm

from ..config import REPLAY_CAPACITY
from ..traffic.logs import LogError, read_requests
from ..traffic.prompt import render_prompt
from ..traffic.render import ChatRenderer
from .characterize import Characterisation
from .recoverability import Recoverability
from .replay import Replay


def analyze_log(path: str | os.PathLike, renderer: ChatRenderer, *,
                capacity: int | None = REPLAY_CAPACITY, strict: bool = False,
                progress: bool = True) -> dict:
    """Run the three analyses over one log in a single streaming pass; returns the JSON report."""
    characterisation, recoverability, replay = Characterisation(), Recoverability(), Replay(capacity)
    errors: list[LogError] = []
    requests = marked = 0
    started = time.perf_counter()
    bar = tqdm(desc=os.path.basename(path), unit=" req", disable=not progress, leave=False)
    for request in read_requests(path, strict=strict, on_error=errors.append):
        prompt = render_prompt(renderer, request.messages, request.tools,
                               session=request.session)
        marked += bool(prompt.markers.size)
        prefix = characterisation.add(prompt)
        recoverability.add(prompt, prefix)
        replay.add(prompt)
        requests += 1
        bar.update()
        bar.set_postfix_str(f"{replay.prompt_tokens / 1e6:.1f}M tok", refresh=False)
    bar.close()
    return {
        "log": str(path),
        "requests": requests,
        "prompt_tokens": replay.prompt_tokens,
        "malformed_lines": [str(e) for e in errors],
        "requests_with_markers": marked,
        "tokenizer": renderer.name,
        "seconds": round(time.perf_counter() - started, 2),
        "characterisation": characterisation.result(),
        "recoverability": recoverability.result(),
        "replay": replay.result(),
    }
