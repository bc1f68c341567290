"""Streaming reader for agent request logs (JSON Lines of chat-completions bodies).

One line is one LLM call: ``{"session": str, "call": int, "messages": [...], "tools": [...]}``,
optionally gzip- or xz-compressed. Logs can be >1 GB unpacked, so everything here streams.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import logging
import lzma
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["LogError", "Request", "parse_line", "read_lines", "read_requests", "sample_logs",
           "write_requests"]

_log = logging.getLogger(__name__)

_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

# What a damaged compressed stream raises while being read (not when opened).
_STREAM_ERRORS = (EOFError, lzma.LZMAError, gzip.BadGzipFile, zlib.error)

# Shipped samples, in the order sample_logs() promises (tau-bench first).
_SAMPLES = ("tau-bench-airline.sample.jsonl.xz", "mini-swe-agent.sample.jsonl.xz")


@dataclass(frozen=True)
class Request:
    """One logged LLM call: the full prompt (``messages``) plus where it belongs."""

    session: str  # "session" field, or f"{file_stem}:{line_no}" when absent
    call: int  # "call" field, or 0
    messages: list[dict]
    tools: list[dict] | None
    source: str  # "path:line_no", for error messages
    # Line number in the log (1-based; 0 when not read from a log): what ``source`` names, so
    # not compared.
    line: int = field(default=0, compare=False)


class LogError(ValueError):
    """A malformed line or damaged file; the message reads ``"path:line: what was wrong"``."""

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem


def _open_binary(path: str, mode: str = "rb") -> IO[bytes]:
    # Binary, not text mode: each line is decoded as UTF-8 on its own, so a bad byte spoils
    # only its line (reported with its number) instead of failing a whole decoder chunk.
    if path.endswith(".xz"):
        return lzma.open(path, mode)
    if path.endswith(".gz"):
        return gzip.open(path, mode)
    return open(path, mode)


def _stem(path: str) -> str:
    """File name without compression and .jsonl suffixes: "a/x.jsonl.xz" -> "x"."""
    name = Path(path).name
    for suffix in (".xz", ".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def parse_line(path: str | os.PathLike[str], line_no: int, raw: bytes) -> Request:
    """The Request on line ``line_no`` (non-blank) of the log at ``path``, as
    :func:`read_requests` reads it; a LogError naming file and line if it is malformed."""
    name = os.fspath(path)
    return _parse(raw, f"{name}:{line_no}", f"{_stem(name)}:{line_no}", line_no)


def _parse(raw: bytes, source: str, fallback_session: str, line_no: int) -> Request:
    """Validate one non-blank line and build its Request; raise LogError if malformed."""
    try:
        obj: Any = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise LogError(source, f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise LogError(source, f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise LogError(source, f"line is a JSON {type(obj).__name__}, not an object")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        what = "missing" if messages is None else "not a non-empty list"
        raise LogError(source, f"'messages' is {what}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise LogError(source, f"messages[{i}] is not an object")
        role = msg.get("role")
        if not isinstance(role, str):
            what = "has no 'role'" if "role" not in msg else "'role' is not a string"
            raise LogError(source, f"messages[{i}] {what}")
        if role not in _ROLES:
            raise LogError(source, f"messages[{i}] has unknown role {role!r}")
    # null tools is how some clients say "no tools"; treat it like an absent field.
    tools = obj.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise LogError(source, "'tools' is not a list")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise LogError(source, f"tools[{i}] is not an object")
    call = obj.get("call", 0)
    # bool is a subclass of int in Python, but true/false is never a call index.
    if not isinstance(call, int) or isinstance(call, bool):
        raise LogError(source, f"'call' is not an integer: {call!r}")
    session = obj.get("session", fallback_session)
    if not isinstance(session, str):
        raise LogError(source, f"'session' is not a string: {session!r}")
    return Request(session=session, call=call, messages=messages, tools=tools, source=source,
                   line=line_no)


def _warn(err: LogError) -> None:  # default on_error
    _log.warning("%s", err)


def read_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes]]:
    """Every non-blank line of a JSON Lines log (plain, ``.gz`` or ``.xz``, chosen by suffix) as
    (line number, raw bytes), unparsed. A truncated or corrupt compressed stream raises a
    LogError naming the last good line, after the lines before it."""
    name = os.fspath(path)
    line_no = 0
    with _open_binary(name) as f:
        lines = iter(f)
        while True:
            try:
                raw = next(lines)
            except StopIteration:
                return
            except _STREAM_ERRORS as exc:
                problem = f"compressed data truncated or corrupt after this line ({exc})"
                raise LogError(f"{name}:{line_no}", problem) from exc
            line_no += 1
            if raw.strip():
                yield line_no, raw


def read_requests(
    path: str | os.PathLike[str],
    *,
    strict: bool = False,
    on_error: Callable[[LogError], None] | None = None,
) -> Iterator[Request]:
    """Stream the requests of a JSON Lines log (plain, ``.gz`` or ``.xz``, chosen by suffix).

    Blank lines are skipped. A malformed line becomes a :class:`LogError` naming file and line:
    with ``strict`` it is raised; otherwise it goes to ``on_error`` (default: a logging WARNING)
    and the line is skipped. A truncated or corrupt compressed stream becomes a LogError naming
    the last good line; it is raised in strict mode, otherwise reported and iteration stops.
    A request without a "session" field gets its own session, ``f"{file_stem}:{line_no}"``.
    """
    report = on_error if on_error is not None else _warn
    lines = read_lines(path)
    while True:
        try:
            line_no, raw = next(lines)
        except StopIteration:
            return
        except LogError as err:  # the compressed stream is damaged: nothing more to read
            if strict:
                raise
            report(err)
            return
        try:
            request = parse_line(path, line_no, raw)
        except LogError as err:
            if strict:
                raise
            report(err)
            continue
        # Yield outside the try so errors thrown into the generator are not swallowed.
        yield request


def write_requests(path: str | os.PathLike[str], requests: Iterable[dict[str, Any]]) -> int:
    """Write request bodies as a JSON Lines log (``.gz``/``.xz`` by suffix); returns the count."""
    count = 0
    with _open_binary(os.fspath(path), "wb") as f:
        for request in requests:
            f.write(json.dumps(request, ensure_ascii=False).encode("utf-8") + b"\n")
            count += 1
    return count


def sample_logs() -> list[Path]:
    """Paths of the shipped sample logs: tau-bench airline first, then mini-swe-agent."""
    root = importlib.resources.files("irminsul") / "data" / "samples"
    # The package is installed as plain files (setuptools, not zipped), so str() is a real path.
    return [Path(str(root / name)) for name in _SAMPLES]
