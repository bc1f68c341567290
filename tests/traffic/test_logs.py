"""Tests for irminsul.traffic.logs: the streaming request-log reader and the shipped samples."""

from __future__ import annotations

import gzip
import json
import logging
import lzma
import random
from collections import Counter
from pathlib import Path

import pytest

from irminsul.traffic.logs import LogError, Request, read_requests, sample_logs

OPENERS = {"": open, ".gz": gzip.open, ".xz": lzma.open}


def write_log(path: Path, lines: list[str]) -> Path:
    """Write lines (already serialised) to path, compressed according to its suffix."""
    with OPENERS[path.suffix if path.suffix in (".gz", ".xz") else ""](path, "wb") as f:
        f.write("".join(line + "\n" for line in lines).encode("utf-8"))
    return path


def req(session: str | None = "s", call: int | None = 0, **extra: object) -> str:
    body: dict = {"messages": [{"role": "user", "content": f"hi {session} {call}"}], **extra}
    if session is not None:
        body["session"] = session
    if call is not None:
        body["call"] = call
    return json.dumps(body)


def collect(path: Path, **kw: object) -> tuple[list[Request], list[LogError]]:
    errors: list[LogError] = []

    def on_error(err: LogError) -> None:
        errors.append(err)
        # A reader that keeps going after a stream error would loop forever; fail instead.
        assert len(errors) < 1000, f"runaway error reporting: {err}"

    return list(read_requests(path, on_error=on_error, **kw)), errors


@pytest.mark.parametrize("suffix", ["", ".gz", ".xz"])
def test_round_trip(tmp_path: Path, suffix: str) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "héllo ✓"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        {"role": "tool", "content": "out", "tool_call_id": "1", "name": "f"},
        {"role": "developer", "content": [{"type": "text", "text": "x"}]},
    ]
    lines = [
        json.dumps({"session": "a", "call": 0, "messages": messages[:2], "tools": tools}),
        "",  # blank lines are skipped without an error
        json.dumps({"session": "a", "call": 1, "messages": messages, "tools": []}),
        json.dumps({"messages": messages[1:2], "tools": None}),  # no session/call/tools
    ]
    path = write_log(tmp_path / f"log.jsonl{suffix}", lines)
    got, errors = collect(path)
    assert errors == []
    assert got == [
        Request("a", 0, messages[:2], tools, f"{path}:1"),
        Request("a", 1, messages, [], f"{path}:3"),
        Request("log:4", 0, messages[1:2], None, f"{path}:4"),
    ]
    assert list(read_requests(str(path), strict=True)) == got  # str paths work too


BAD_LINES = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "not an object"),
    ('"text"', "not an object"),
    ('{"session": "s"}', "'messages' is missing"),
    ('{"messages": []}', "'messages' is not a non-empty list"),
    ('{"messages": {"role": "user"}}', "'messages' is not a non-empty list"),
    ('{"messages": [{"role": "user"}, "hi"]}', "messages[1] is not an object"),
    ('{"messages": [{"role": "user"}, {"role": "user"}, {"content": "x"}]}',
     "messages[2] has no 'role'"),
    ('{"messages": [{"role": 3}]}', "messages[0] 'role' is not a string"),
    ('{"messages": [{"role": "robot"}]}', "messages[0] has unknown role 'robot'"),
    ('{"messages": [{"role": "user"}], "tools": {"a": 1}}', "'tools' is not a list"),
    ('{"messages": [{"role": "user"}], "tools": [1]}', "tools[0] is not an object"),
    ('{"messages": [{"role": "user"}], "call": "3"}', "'call' is not an integer"),
    ('{"messages": [{"role": "user"}], "call": 1.5}', "'call' is not an integer"),
    ('{"messages": [{"role": "user"}], "call": true}', "'call' is not an integer"),
    ('{"messages": [{"role": "user"}], "session": 7}', "'session' is not a string"),
]


@pytest.mark.parametrize("suffix", ["", ".xz"])
@pytest.mark.parametrize(("bad", "problem"), BAD_LINES)
def test_malformed_line_reported_and_skipped(
    tmp_path: Path, suffix: str, bad: str, problem: str
) -> None:
    path = write_log(
        tmp_path / f"x.jsonl{suffix}", [req("s", 0), req("s", 1), "", bad, req("s", 2)]
    )
    got, errors = collect(path)
    assert [r.source for r in got] == [f"{path}:1", f"{path}:2", f"{path}:5"]
    assert [r.call for r in got] == [0, 1, 2]
    assert len(errors) == 1
    assert errors[0].source == f"{path}:4"
    assert str(errors[0]).startswith(f"{path}:4: ")
    assert problem in str(errors[0])


def test_invalid_utf8_spoils_only_its_line(tmp_path: Path) -> None:
    path = tmp_path / "u.jsonl"
    bad = b'{"x": "\xff\xfe"}'
    path.write_bytes(b"\n".join([req("s", 0).encode(), bad, req("s", 1).encode(), b""]))
    got, errors = collect(path)
    assert [r.call for r in got] == [0, 1]
    assert [e.source for e in errors] == [f"{path}:2"]
    assert "UTF-8" in str(errors[0])


def test_default_on_error_logs_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_log(tmp_path / "x.jsonl", [req(), '{"messages": [{"role": "bot"}]}', req()])
    with caplog.at_level(logging.WARNING, logger="irminsul.traffic.logs"):
        got = list(read_requests(path))
    assert len(got) == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [f"{path}:2: messages[0] has unknown role 'bot'"]


def test_strict_raises_on_first_bad_line(tmp_path: Path) -> None:
    path = write_log(
        tmp_path / "x.jsonl.gz", [req("s", 0), "{oops", req("s", 1), '{"messages": 1}']
    )
    it = read_requests(path, strict=True)
    assert next(it).call == 0  # lines before the error are still delivered
    with pytest.raises(LogError, match=r"x\.jsonl\.gz:2: invalid JSON") as info:
        next(it)
    assert info.value.source == f"{path}:2"


def big_log(path: Path, n: int = 300) -> Path:
    """A compressed log of n requests with incompressible content, so cutting it loses lines."""
    rng = random.Random(0)
    return write_log(
        path, [req("s", i, pad=rng.getrandbits(4000).to_bytes(500, "big").hex()) for i in range(n)]
    )


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        del data[len(data) // 2 :]
    else:  # flip bytes in the middle of the compressed stream
        for i in range(len(data) // 2, len(data) // 2 + 64):
            data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "corrupt"])
@pytest.mark.parametrize("suffix", [".gz", ".xz"])
def test_damaged_compressed_file_non_strict(tmp_path: Path, suffix: str, how: str) -> None:
    path = big_log(tmp_path / f"big.jsonl{suffix}")
    damage(path, how)
    got, errors = collect(path)
    # Some prefix came through intact, in order, and then iteration stopped on a stream error.
    assert 0 < len(got) < 300
    assert [r.call for r in got] == list(range(len(got)))
    assert "truncated or corrupt" in str(errors[-1])
    if suffix == ".gz" and how == "corrupt":
        # gzip checks its CRC only at the end of the stream, so the garbage decoded before that
        # shows up first as malformed lines (each reported and skipped), all after the good ones.
        assert all("truncated or corrupt" not in str(e) for e in errors[:-1])
        assert all(int(e.source.rsplit(":", 1)[1]) > len(got) for e in errors)
    else:
        assert len(errors) == 1
        assert errors[0].source == f"{path}:{len(got)}"  # names the last good line


@pytest.mark.parametrize("suffix", [".gz", ".xz"])
def test_truncated_compressed_file_strict(tmp_path: Path, suffix: str) -> None:
    path = big_log(tmp_path / f"big.jsonl{suffix}")
    damage(path, "truncate")
    got: list[Request] = []
    with pytest.raises(LogError, match="truncated or corrupt") as info:
        for r in read_requests(path, strict=True):
            got.append(r)
    assert 0 < len(got) < 300
    assert info.value.source == f"{path}:{len(got)}"


def test_sample_logs_shipped_and_parse_cleanly() -> None:
    paths = sample_logs()
    assert [p.name for p in paths] == [
        "tau-bench-airline.sample.jsonl.xz",
        "mini-swe-agent.sample.jsonl.xz",
    ]
    expected = {  # (sessions, requests)
        "tau-bench-airline.sample.jsonl.xz": (12, 177),
        "mini-swe-agent.sample.jsonl.xz": (4, 54),
    }
    for path in paths:
        got, errors = collect(path)
        assert errors == []
        calls = Counter(r.session for r in got)
        assert (len(calls), len(got)) == expected[path.name]
        for session, n in calls.items():  # complete sessions: calls 0..n-1, each once
            assert sorted(r.call for r in got if r.session == session) == list(range(n))
        # The prompt of call k+1 extends that of call k (history grows by appending).
        for a, b in zip(got, got[1:]):
            if a.session == b.session:
                assert b.messages[: len(a.messages)] == a.messages
    for lic in ("LICENSE.tau-bench", "LICENSE.mini-swe-agent"):
        assert "MIT License" in (paths[0].parent / lic).read_text()
