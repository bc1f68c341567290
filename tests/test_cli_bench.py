"""What ``irminsul bench`` shows a person: progress while it runs, a unit on every figure."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.tiny_chat_model import build, workload

from irminsul.cli import main
from irminsul.traffic.logs import write_requests


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bench-cli")
    log = root / "chat.jsonl"
    write_requests(log, workload())
    return build(root / "model"), log


def _bench(paths: tuple[Path, Path], *flags: str) -> list[str]:
    model, log = paths
    return ["bench", "--model", str(model), "--workload", str(log), *flags]


def test_progress_on_stderr_and_units_on_every_figure(paths: tuple[Path, Path],
                                                      capsys: pytest.CaptureFixture) -> None:
    assert main(_bench(paths)) == 0
    out, err = capsys.readouterr()
    for stage in ("reference", "off", "observer", "live"):
        assert f"bench: {stage}" in err
    assert f"chat.jsonl: {len(workload())} requests, " in out
    assert " prompt tokens; KV pool " in out and " tokens per engine" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("workload"))
    for column in ("TTFT p50 (ms)", "TTFT p95 (ms)", "KL vs full (nats)"):
        assert column in header
    rows = [line.split() for line in lines if line.startswith("chat.jsonl  ")]
    assert [row[1] for row in rows] == ["off", "observer", "live"]
    for row in rows:  # the shares carry their % sign; the other columns' units are in the header
        assert all(cell.endswith("%") for cell in row[2:5])


def test_quiet_shows_no_progress(paths: tuple[Path, Path], capsys: pytest.CaptureFixture) -> None:
    assert main(_bench(paths, "-q")) == 0
    assert "bench:" not in capsys.readouterr().err
