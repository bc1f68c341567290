"""Cut the small sample logs shipped in irminsul/data/samples from the full real logs.

Usage: python tools/cut_samples.py [TRACES_DIR] [OUT_DIR]
(defaults: /work/shared/traces and irminsul/data/samples next to this script).

Deterministic: sessions are chosen by file order and call counts only, and the chosen lines are
copied byte for byte (never re-serialised), so a rerun writes identical data. Input is streamed;
the mini-swe-agent log is 1.2 GB unpacked.
"""

from __future__ import annotations

import json
import lzma
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

TAU_SESSIONS = 12  # first 12 sessions in file order
SWE_SESSIONS = 4  # the 4 sessions with the fewest calls ...
SWE_MIN_CALLS = 8  # ... among those with at least this many calls (real multi-turn runs)


def lines(path: Path) -> Iterator[tuple[bytes, str]]:
    """Yield (raw line, session) for each non-blank line, streaming."""
    with lzma.open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                yield raw, json.loads(raw)["session"]


def call_counts(path: Path) -> dict[str, int]:
    """Calls per session, keys in order of first appearance."""
    counts: dict[str, int] = {}
    for _, session in lines(path):
        counts[session] = counts.get(session, 0) + 1
    return counts


def first_sessions(path: Path, n: int) -> set[str]:
    """The first n distinct sessions in file order (stops reading once they are known)."""
    seen: dict[str, None] = {}
    for _, session in lines(path):
        seen.setdefault(session, None)
        if len(seen) > n:
            break
    return set(list(seen)[:n])


def fewest_calls(path: Path, n: int, min_calls: int) -> set[str]:
    """The n sessions with the fewest calls among those with >= min_calls (ties: file order)."""
    counts = call_counts(path)
    order = {s: i for i, s in enumerate(counts)}
    eligible = [s for s, c in counts.items() if c >= min_calls]
    return set(sorted(eligible, key=lambda s: (counts[s], order[s]))[:n])


def content_chars(request: dict) -> int:
    """Characters of message content (string content, or the text parts of a list)."""
    total = 0
    for m in request["messages"]:
        c = m.get("content")
        if isinstance(c, str):
            total += len(c)
        elif isinstance(c, list):
            total += sum(len(p.get("text", "")) for p in c if isinstance(p, dict))
    return total


def cut(src: Path, dst: Path, choose: Callable[[Path], set[str]]) -> None:
    """Copy every line of the chosen sessions from src to dst (xz preset 9), in file order."""
    chosen = choose(src)
    requests = chars = 0
    sessions: set[str] = set()
    with lzma.open(dst, "wb", preset=9) as out:
        for raw, session in lines(src):
            if session in chosen:
                # Ensure a final newline so the output stays one request per line.
                out.write(raw if raw.endswith(b"\n") else raw + b"\n")
                requests += 1
                chars += content_chars(json.loads(raw))
                sessions.add(session)
    assert sessions == chosen, f"sessions missing from {src}: {chosen - sessions}"
    print(
        f"{dst}: {len(sessions)} sessions, {requests} requests, "
        f"{chars:,} content chars, {dst.stat().st_size:,} bytes"
    )


def main(argv: list[str]) -> None:
    here = Path(__file__).resolve().parent
    traces = Path(argv[1]) if len(argv) > 1 else Path("/work/shared/traces")
    out = Path(argv[2]) if len(argv) > 2 else here.parent / "irminsul" / "data" / "samples"
    out.mkdir(parents=True, exist_ok=True)
    cut(
        traces / "tau-bench-airline.requests.jsonl.xz",
        out / "tau-bench-airline.sample.jsonl.xz",
        lambda p: first_sessions(p, TAU_SESSIONS),
    )
    cut(
        traces / "mini-swe-agent-gemini3pro.requests.jsonl.xz",
        out / "mini-swe-agent.sample.jsonl.xz",
        lambda p: fewest_calls(p, SWE_SESSIONS, SWE_MIN_CALLS),
    )
    for lic in ("LICENSE.tau-bench", "LICENSE.mini-swe-agent"):
        shutil.copyfile(traces / lic, out / lic)


if __name__ == "__main__":
    main(sys.argv)
