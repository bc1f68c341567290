"""The command line: analyze's JSON contract, malformed input, workload writing."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

import pytest

from irminsul.cli import main
from irminsul.traffic.logs import read_requests, sample_logs


def _small_log(tmp_path: Path, bad_line: str | None = None) -> Path:
    with lzma.open(sample_logs()[0], "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(20)]
    if bad_line is not None:
        lines.insert(5, bad_line + "\n")
    path = tmp_path / "log.jsonl"
    path.write_text("".join(lines), encoding="utf-8")
    return path


def test_analyze_json_contract(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "report.json"
    assert main(["-q", "analyze", str(_small_log(tmp_path)), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 20
    assert report["prompt_tokens"] > 20 * 1000
    replay = report["replay"]
    for name in ("cdc", "cdc+s1", "s2", "s2+s1", "msg", "msg+s1", "default"):
        r = replay[name]
        assert r["total"] == pytest.approx(r["exact_prefix"] + r["pic_unique"])
    assert replay["default"]["strategy"] == "msg+s1"
    assert "Serve-path replay" in capsys.readouterr().out


def test_malformed_line_is_reported_and_skipped(tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    log = _small_log(tmp_path, bad_line='{"messages": "oops"')
    out = tmp_path / "report.json"
    assert main(["-q", "analyze", str(log), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 20
    assert len(report["malformed_lines"]) == 1
    assert f"{log}:6:" in report["malformed_lines"][0]


def test_strict_fails_with_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    log = _small_log(tmp_path, bad_line="[1, 2]")
    assert main(["-q", "analyze", "--strict", str(log)]) == 2
    assert f"{log}:6:" in capsys.readouterr().err


def test_missing_log_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["-q", "analyze", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_workload_command(tmp_path: Path) -> None:
    out = tmp_path / "w.jsonl.xz"
    assert main(["workload", "rerank", "--out", str(out), "--requests", "7", "--markers"]) == 0
    requests = list(read_requests(out, strict=True))
    assert len(requests) == 7
    assert all(r.messages[-1]["content"].startswith("Retrieved documents") for r in requests)
