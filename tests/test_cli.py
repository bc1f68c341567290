"""The command line: analyze's JSON contract, malformed input, workload writing, --version,
help on every option and the global options' place."""

from __future__ import annotations

import argparse
import json
import lzma
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

import irminsul
from irminsul.cli import build_parser, main
from irminsul.model import default_model_dir
from irminsul.traffic.logs import read_requests, sample_logs
from irminsul.traffic.render import ChatRenderer


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
    for name in ("engine", "cdc", "cdc+s1", "s2", "s2+s1", "msg", "msg+s1", "default",
                 "algorithm1"):
        r = replay[name]
        assert r["total"] == pytest.approx(r["exact_prefix"] + r["pic_unique"])
    assert replay["default"]["strategy"] == "engine"
    assert replay["algorithm1"]["strategy"] == "msg+s1"
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


def test_malformed_lines_are_counted_on_screen(tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    """Without --json the skipped lines are still reported: how many, and where the first was."""
    log = _small_log(tmp_path, bad_line='{"messages": "oops"')
    with log.open("a", encoding="utf-8") as f:
        f.write("not json\n")
    assert main(["-q", "analyze", str(log)]) == 0
    err = capsys.readouterr().err
    assert "skipped 2 malformed lines" in err
    assert f"first: {log}:6:" in err


def test_clean_log_warns_of_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["-q", "analyze", str(_small_log(tmp_path))]) == 0
    assert "malformed" not in capsys.readouterr().err


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


def test_version(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"irminsul {irminsul.__version__}\n"
    assert irminsul.__version__ == metadata.version("irminsul")


def test_version_without_package_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source tree that was never installed still has a version to print."""
    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert irminsul._installed_version() == irminsul.UNKNOWN_VERSION


def _parsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """The parser and every subcommand's parser, each with its command line prefix."""
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_has_help() -> None:
    parser = build_parser()
    missing = [f"{prog} {'/'.join(action.option_strings) or action.dest}"
               for prog, p in _parsers(parser) for action in p._actions
               if not (action.help or "").strip() or action.help == argparse.SUPPRESS]
    progs = {prog for prog, _ in _parsers(parser)}  # the walk reaches every command
    assert {f"irminsul {c}".strip() for c in ("", "analyze", "workload", "demo", "consistency",
                                              "gate", "bench", "bench serve", "serve")} <= progs
    assert missing == []


COMMANDS = {"analyze": ["LOG"], "workload": ["rerank", "--out", "W"], "demo": [],
            "consistency": [], "bench": [], "bench serve": []}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_global_options_before_or_after_the_command(command: str) -> None:
    """--tokenizer and -q mean the same before and after the command; after wins."""
    parse, rest, command = build_parser().parse_args, COMMANDS[command], command.split()
    for argv in (["--tokenizer", "DIR", "-q", *command, *rest],
                 [*command, *rest, "--tokenizer", "DIR", "-q"],
                 ["--tokenizer", "OTHER", *command, *rest, "--quiet", "--tokenizer", "DIR"]):
        args = parse(argv)
        assert (args.tokenizer, args.quiet) == ("DIR", True), argv
    args = parse([*command, *rest])
    assert (args.tokenizer, args.quiet) == (None, False)
    assert "model_tokenizer" not in vars(args)  # bench and consistency's own copy is gone


def test_serve_refuses_a_tokenizer(capsys: pytest.CaptureFixture) -> None:
    """serve renders with the model's own tokenizer, so --tokenizer is refused, not ignored."""
    assert main(["--tokenizer", "DIR", "serve"]) == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_analyze_takes_tokenizer_after_the_log(tmp_path: Path) -> None:
    """The README's own example: irminsul analyze LOG --tokenizer DIR."""
    tokenizer, out = default_model_dir(), tmp_path / "report.json"
    assert main(["analyze", str(_small_log(tmp_path)), "--tokenizer", str(tokenizer), "-q",
                 "--json", str(out)]) == 0
    name = json.loads(out.read_text())["tokenizer"]
    assert name == ChatRenderer.from_dir(tokenizer).name != ChatRenderer.default().name


@pytest.mark.parametrize("argv, needle", [
    (["serve", "--slots", "0"], "slots must be >= 1"),
    (["serve", "--kr-slots", "-1"], "kr_slots must be >= 1"),
    (["serve", "--max-waiting", "-1"], "max_waiting must be >= 0"),
    (["serve", "--max-request-bytes", "0"], "max_request_bytes must be >= 1"),
    (["serve", "--recompute-head", "-1"], "recompute_head must be >= 0"),
    (["serve", "--recompute-share", "1.5"], "recompute_share must be in [0, 1]"),
    (["serve", "--recompute-check-layer", "0"], "recompute_check_layer must be >= 1"),
])
def test_serve_refuses_bad_sizes_before_loading(argv: list[str], needle: str, capsys) -> None:
    """A size that cannot work is an error naming it (it used to mean 65,536 slots)."""
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_serve_store_flags_reach_the_store_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """--store, --store-prefill-rate and --store-model-id land in the server's StoreConfig
    (the model id names the model in the store's keys: docs/scale-out.md)."""
    import irminsul.server

    served = {}
    monkeypatch.setattr(irminsul.server, "serve",
                        lambda model_dir, config, parallel: served.update(store=config.store))
    assert main(["serve", "--device", "cpu", "--store", "redis://127.0.0.1:6379",
                 "--store-prefill-rate", "5000", "--store-model-id", "v3-fp8"]) == 0
    store = served["store"]
    assert (store.url, store.prefill_tokens_per_second, store.model_id) == (
        "redis://127.0.0.1:6379", 5000.0, "v3-fp8")


def test_serve_collective_timeout_reaches_the_parallel_config(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import irminsul.server

    served = {}
    monkeypatch.setattr(irminsul.server, "serve",
                        lambda model_dir, config, parallel: served.update(parallel=parallel))
    assert main(["serve", "--device", "cpu", "--collective-timeout", "240"]) == 0
    assert served["parallel"].timeout_s == 240.0
    assert main(["serve", "--device", "cpu", "--collective-timeout", "0"]) == 2
    assert "timeout_s must be > 0, got 0.0" in capsys.readouterr().err
