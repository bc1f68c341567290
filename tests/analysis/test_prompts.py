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


def _damaged_log(tmp_path: Path) -> Path:
    """60 sample requests with malformed lines among them (blank lines, bad JSON, a line without
    a session, an escaped quote in a session name), xz-compressed and cut short."""
    with lzma.open(sample_logs()[0], "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(60)]
    lines[3:3] = ["\n", '{"messages": "oops"}\n']
    lines[20:20] = ['{"session": "a\\"b", "messages": [{"role": "user", "content": "x"}]}\n',
                    '{"messages": [{"role": "user", "content": "no session"}]}\n', "not json\n"]
    lines.insert(41, '{"session": "s", "messages": [{"role": "wizard", "content": "x"}]}\n')
    data = lzma.compress("".join(lines).encode("utf-8"))
    log = tmp_path / "log.jsonl.xz"
    log.write_bytes(data[:len(data) * 4 // 5])  # the stream ends inside some line
    return log


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_merge_in_order_around_damage(tmp_path: Path, workers: int) -> None:
    """Malformed lines on several workers' lines and a damaged stream: the workers give the
    prompts a direct read gives, in order, and the same errors in the same order."""
    log = _damaged_log(tmp_path)
    direct_errors, errors = [], []
    renderer = ChatRenderer.default()
    expected = [render_prompt(renderer, r.messages, r.tools, session=r.session)
                for r in read_requests(log, on_error=direct_errors.append)]
    got = [prompt for prompt, _ in rendered_prompts(log, ChatRenderer.default(),
                                                     on_error=errors.append, workers=workers)]
    assert [(p.session, p.tokens.tolist()) for p in got] == \
        [(p.session, p.tokens.tolist()) for p in expected]
    assert [str(e) for e in errors] == [str(e) for e in direct_errors]
    assert len(errors) == 4 and "truncated or corrupt" in str(errors[-1])


@pytest.mark.parametrize("workers", [2, 3])
def test_strict_workers_stop_where_a_direct_read_does(tmp_path: Path, workers: int) -> None:
    """In strict mode the workers hand on exactly the prompts before the first malformed line,
    then raise its error, as a direct read does."""
    log = _damaged_log(tmp_path)
    renderer = ChatRenderer.default()
    expected, got = [], []
    with pytest.raises(ValueError) as direct:
        for r in read_requests(log, strict=True):
            expected.append(render_prompt(renderer, r.messages, r.tools, session=r.session))
    with pytest.raises(ValueError) as raised:
        for prompt, _ in rendered_prompts(log, ChatRenderer.default(), strict=True,
                                          workers=workers):
            got.append(prompt)
    assert str(raised.value) == str(direct.value) and ":5:" in str(direct.value)
    assert [p.tokens.tolist() for p in got] == [p.tokens.tolist() for p in expected]
    assert len(got) == 3
