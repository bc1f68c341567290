"""Rendering a log in worker processes gives every request's prompt, in log order, as rendering it
directly does, and reports the same malformed lines."""

from __future__ import annotations

import lzma
from pathlib import Path

import numpy as np
import pytest

from irminsul.analysis.characterize import ROLES
from irminsul.analysis.prompts import rendered_prompts
from irminsul.traffic.logs import read_requests, sample_logs
from irminsul.traffic.prompt import render_prompt
from irminsul.traffic.render import ChatRenderer


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_workers_render_every_request_in_order(tmp_path: Path, workers: int) -> None:
    with lzma.open(sample_logs()[1], "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(40)]
    lines.insert(7, '{"messages": "oops"}\n')
    log = tmp_path / "log.jsonl"
    log.write_text("".join(lines), encoding="utf-8")
    direct_errors, errors = [], []
    renderer = ChatRenderer.default()
    expected = [(render_prompt(renderer, r.messages, r.tools, session=r.session), r)
                for r in read_requests(log, on_error=direct_errors.append)]
    got = list(rendered_prompts(log, ChatRenderer.default(), on_error=errors.append,
                                workers=workers))
    assert len(got) == len(expected) == 40
    for (prompt, roles), (want, request) in zip(got, expected):
        assert prompt.session == want.session
        assert np.array_equal(prompt.tokens, want.tokens)
        assert np.array_equal(prompt.resets, want.resets)
        assert [ROLES[r] for r in roles] == [m["role"] for m in request.messages]
    assert [str(e) for e in errors] == [str(e) for e in direct_errors]
    assert len(errors) == 1 and ":8:" in str(errors[0])


def test_strict_raises_from_a_worker(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": 3}\n',
                   encoding="utf-8")
    with pytest.raises(ValueError, match="'messages' is not a non-empty list"):
        list(rendered_prompts(log, ChatRenderer.default(), strict=True, workers=2))
