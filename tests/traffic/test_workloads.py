"""Partition-shift workloads: well-formed logs that reproduce the shape of the paper's Table 3."""

from __future__ import annotations

from pathlib import Path

import pytest

from irminsul.analysis.analyze import analyze_log
from irminsul.cache.markers import MARKER_BODY
from irminsul.traffic.logs import read_requests, sample_logs, write_requests
from irminsul.traffic.render import ChatRenderer
from irminsul.traffic.workloads import KEEP_TOOL_RESULTS, PATTERNS, TextPool, build_workload


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer.default()


@pytest.fixture(scope="module")
def bodies() -> list:
    return list(read_requests(sample_logs()[0], strict=True))


@pytest.fixture(scope="module")
def pool(renderer: ChatRenderer) -> TextPool:
    texts = [m["content"] for src in sample_logs() for r in read_requests(src) for m in r.messages
             if isinstance(m.get("content"), str) and m["role"] in ("user", "tool")]
    return TextPool(texts, renderer)


def _analyze(tmp_path: Path, renderer, bodies, pool, pattern: str, **kw) -> dict:
    path = tmp_path / f"{pattern}.jsonl.gz"
    write_requests(path, build_workload(pattern, bodies, pool, **kw))
    return analyze_log(path, renderer, progress=False)


def test_every_pattern_reads_back(tmp_path: Path, renderer, bodies, pool) -> None:
    for pattern in PATTERNS:
        path = tmp_path / f"{pattern}.jsonl.xz"
        assert write_requests(path, build_workload(pattern, bodies, pool, requests=12)) == 12
        assert len(list(read_requests(path, strict=True))) == 12


def test_agent_meta_headers(renderer, bodies, pool) -> None:
    """The header has ~H tokens, precedes the untouched system prompt, and differs per request."""
    reqs = list(build_workload("agent_meta", bodies, pool, requests=6, header_tokens=250))
    systems = [r["messages"][0]["content"] for r in reqs]
    for req, body, system in zip(reqs, bodies, systems):
        assert system.endswith(body.messages[0]["content"])
        header = system[: len(system) - len(body.messages[0]["content"])]
        assert 230 <= renderer.encode(header).size <= 290
        assert req["messages"][1:] == body.messages[1:]
    assert len(set(systems)) == len(systems)
    marked = next(build_workload("agent_meta", bodies, pool, requests=1, markers=True))
    assert MARKER_BODY in marked["messages"][0]["content"]


def test_compact_keeps_newest_tool_results(bodies, pool) -> None:
    for req, body in zip(build_workload("compact", bodies, pool, requests=40), bodies):
        tools = [i for i, m in enumerate(body.messages) if m["role"] == "tool"]
        for i in tools[-KEEP_TOOL_RESULTS:]:
            assert req["messages"][i] == body.messages[i]
        for i in tools[:-KEEP_TOOL_RESULTS]:
            assert req["messages"][i]["content"].startswith("[compacted tool result")


def test_unknown_pattern(bodies, pool) -> None:
    with pytest.raises(ValueError, match="unknown workload pattern 'nope'"):
        next(build_workload("nope", bodies, pool))


def test_table3_shape(tmp_path: Path, renderer, bodies, pool) -> None:
    """agent_meta: exact-prefix ~2% and Irminsul >= 77 points above it; the deep-variation
    patterns are mostly exact-prefix with the residual filled by PIC."""
    meta = _analyze(tmp_path, renderer, bodies, pool, "agent_meta", requests=60, header_tokens=50)
    default = meta["replay"]["default"]
    assert default["exact_prefix"] < 0.05
    assert default["pic_unique"] >= 0.77
    for pattern in ("compact", "rerank", "tool_variants"):
        d = _analyze(tmp_path, renderer, bodies, pool, pattern, requests=60)["replay"]["default"]
        assert d["exact_prefix"] > 0.5, pattern
        assert d["pic_unique"] > 0.01, pattern
        assert d["total"] > 0.9, pattern


def test_markers_are_found_and_used(tmp_path: Path, renderer, bodies, pool) -> None:
    """With S2 markers in the log, the s2 strategy resets there and recovers at least plain CDC."""
    report = _analyze(tmp_path, renderer, bodies, pool, "agent_meta", requests=30, markers=True)
    assert report["requests_with_markers"] == 30
    replay = report["replay"]
    assert replay["s2"]["pic_unique"] >= replay["cdc"]["pic_unique"]


def test_sysvar_partition_shift(tmp_path: Path, renderer, bodies, pool) -> None:
    """The partition-shift diagnostic: exact-prefix stops at the variable, so it grows with the
    variable's depth, and Irminsul serves the shifted residual after it."""
    reports = [_analyze(tmp_path, renderer, bodies, pool, "sysvar", requests=80,
                        header_tokens=depth) for depth in (50, 10**6)]  # the paper's n = 80
    shallow, deep = (r["replay"]["default"] for r in reports)
    assert shallow["exact_prefix"] < deep["exact_prefix"]
    assert deep["exact_prefix"] > 0.15  # everything up to the end of the system prompt
    for report in reports:
        d, novel = report["replay"]["default"], report["characterisation"]["novel"]
        assert d["pic_unique"] > 0.5
        assert d["total"] > 0.9
        assert d["total"] >= 1.0 - novel - 0.05  # all but the genuinely new tokens are served
