"""Review: malformed request shapes in a log are reported as malformed lines (file:line), not a
traceback that aborts the whole analysis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from irminsul.analysis.analyze import analyze_log
from irminsul.traffic.logs import LogError
from irminsul.traffic.render import ChatRenderer

GOOD = {"session": "a", "messages": [{"role": "user", "content": "hello there"}]}
BAD = {
    "text_null": {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
    "text_number": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    "tool_calls_str": {"messages": [{"role": "assistant", "content": "x", "tool_calls": "f"}]},
    "tool_call_str": {"messages": [{"role": "assistant", "content": "x", "tool_calls": ["f"]}]},
    "tool_without_function": {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]},
}


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer.default()


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("kind", sorted(BAD))
def test_unrenderable_line_is_skipped_and_named(tmp_path: Path, renderer: ChatRenderer,
                                                kind: str, workers: int) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(b) for b in (GOOD, BAD[kind], GOOD)) + "\n")
    report = analyze_log(log, renderer, progress=False, workers=workers)
    assert report["requests"] == 2  # both good lines, the bad one skipped
    assert len(report["malformed_lines"]) == 1
    assert report["malformed_lines"][0].startswith(f"{log}:2: ")
    with pytest.raises(LogError, match=f"{log}:2: "):
        analyze_log(log, renderer, progress=False, workers=workers, strict=True)
