"""`irminsul bench serve` end to end on the embedded default model: a server started per mode
(subprocesses) and a running one (--url), with short replies so it stays quick on a CPU."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from fixtures.served_app import served

from irminsul.cli import main
from irminsul.config import EngineConfig, ServerConfig
from irminsul.loadgen.server import free_port
from irminsul.model import default_model_dir
from irminsul.server import build_server

FIGURES = ("ttft_ms", "tpot_ms", "e2e_ms", "session_s")
SCALARS = ("wall_s", "request_throughput_rps", "output_throughput_tps", "prefix_share",
           "pic_share", "computed_share")


def check_summary(summary: dict, calls: int) -> None:
    assert (summary["calls"], summary["failed_calls"]) == (calls, 0)
    for figure in FIGURES:
        assert all(summary[figure][q] is not None for q in ("p50", "p90", "p99", "mean")), figure
        assert summary[figure]["p50"] <= summary[figure]["p90"] <= summary[figure]["p99"]
    assert all(summary[key] is not None for key in SCALARS)
    shares = (summary["prefix_share"] + summary["derived_prefix_share"] + summary["pic_share"]
              + summary["computed_share"])
    assert shares == pytest.approx(1.0)


def test_both_modes_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "serve.json"
    assert main(["-q", "bench", "serve", "--sessions", "2", "--calls", "3",
                 "--max-reply-tokens", "4", "--warmup", "1", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert (report["workload"], report["sessions"], report["calls"]) == ("agent_meta", 2, 6)
    assert list(report["modes"]) == ["off", "live"]
    for mode, run in report["modes"].items():
        assert run["model"] == "default_model" and f"PIC {mode}" in run["server"]["startup_line"]
        check_summary(run["summary"], 6)
        order = [(c["session_index"], c["call_index"]) for c in run["calls"]]
        assert order == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
        assert all(c["max_tokens"] <= 4 and c["logged_reply"] for c in run["calls"])
        assert [s["calls"] for s in run["sessions"]] == [3, 3]
    off, live = (report["modes"][m]["summary"] for m in ("off", "live"))
    assert off["pic_cached_tokens"] == 0 < live["pic_cached_tokens"]
    assert off["prompt_tokens"] == live["prompt_tokens"]  # the same calls
    assert set(report["live_vs_off"]) == {
        "session_p50_speedup", "request_throughput_ratio", "output_throughput_ratio",
        "ttft_p50_speedup", "live_ttft_p99_over_off_ttft_p50"}
    assert all(v > 0 for v in report["live_vs_off"].values())
    assert "agent_meta: 2 sessions, 6 calls" in stdout
    for label in ("TTFT p99", "TPOT p50", "session wall p90", "served by PIC", "live / off"):
        assert label in stdout


def running_server(pic: str) -> contextlib.AbstractContextManager[str]:
    """The default model served in-process on a free port."""
    app, _ = build_server(default_model_dir(), ServerConfig(device="cpu", engine=EngineConfig(mode=pic)))
    return served(app)


def test_a_running_server_by_url(tmp_path: Path) -> None:
    """One replay, whatever the server runs, under a cache salt of its own: twice in a row,
    the second finds nothing the first left (the same exact-prefix and PIC figures)."""
    reports = []
    with running_server("live") as url:
        for i in range(2):
            out = tmp_path / f"url{i}.json"
            assert main(["-q", "bench", "serve", "--url", url, "--sessions", "1", "--calls", "2",
                         "--max-reply-tokens", "2", "--warmup", "0", "--json", str(out)]) == 0
            reports.append(json.loads(out.read_text()))
    for report in reports:
        assert list(report["modes"]) == ["server"] and "live_vs_off" not in report
        run = report["modes"]["server"]
        assert run["server"]["url"] == url and run["server"]["cache_salt"]
        check_summary(run["summary"], 2)
        assert run["summary"]["pic_cached_tokens"] > 0  # the second call reuses the first
    first, second = (r["modes"]["server"] for r in reports)
    assert first["server"]["cache_salt"] != second["server"]["cache_salt"]
    assert [c["cached_tokens"] for c in first["calls"]] == [
        c["cached_tokens"] for c in second["calls"]]


@pytest.mark.parametrize(("argv", "message"), [
    (["--url", "http://127.0.0.1:9", "--model", "DIR"], "--url replays against a running"),
    (["--model", "DIR", "--random-weights", "C.json"], "does not take --model"),
    (["--server-args", "--pic live"], "sets --pic itself"),
    (["--reply-tokens", "0"], "--reply-tokens"),
    (["--url", "http://127.0.0.1:9", "--workload", "nope"], "nor a workload name"),
    # refused up front, not after a server per mode has started (minutes on a GPU), and a
    # concurrency of 0 not replaced by the default 4 without a word
    (["--url", "http://127.0.0.1:9", "--concurrency", "0"], "--concurrency must be >= 1"),
    (["--url", "http://127.0.0.1:9", "--session-rate", "0"], "--session-rate must be > 0"),
    (["--url", "http://127.0.0.1:9", "--session-rate", "-2", "--concurrency", "2"],
     "--session-rate must be > 0"),
    (["--url", "http://127.0.0.1:9", "--think-time", "-1"], "--think-time must be >= 0"),
])
def test_refused_before_anything_runs(argv: list[str], message: str,
                                      capsys: pytest.CaptureFixture) -> None:
    assert main(["-q", "bench", "serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_an_unreachable_url_is_an_error(capsys: pytest.CaptureFixture) -> None:
    assert main(["-q", "bench", "serve", "--url", f"http://127.0.0.1:{free_port()}",
                 "--sessions", "1", "--calls", "1"]) == 2
    assert "no model id from /v1/models" in capsys.readouterr().err


def test_plain_bench_is_still_the_engine_replay() -> None:
    from irminsul.cli import build_parser
    from irminsul.cli.bench import cmd_bench, cmd_bench_serve

    parse = build_parser().parse_args
    assert parse(["bench"]).func is cmd_bench
    assert parse(["bench", "--requests", "2", "-q"]).func is cmd_bench
    assert parse(["bench", "serve"]).func is cmd_bench_serve


def test_failed_calls_are_said_and_a_replay_without_any_answer_is_an_error(
        capsys: pytest.CaptureFixture) -> None:
    from irminsul.cli.bench import _warn_failed_calls

    calls = [{"error": None}, {"error": "HTTP 429: too many"}, {"error": "HTTP 500: boom"}]
    _warn_failed_calls({"workload": "w", "modes": {"live": {"calls": calls}}})
    assert "w, live: 2 calls failed" in capsys.readouterr().err
    with pytest.raises(ValueError, match="every call failed; the first: HTTP 429"):
        _warn_failed_calls({"workload": "w", "modes": {"off": {"calls": calls[1:]}}})
