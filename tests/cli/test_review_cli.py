"""Review: CLI values that are out of range are refused up front, not silently reinterpreted
(a negative --requests slicing off the log's last requests, --slots 0 taken as the default) or
accepted until the server binds its socket after loading the model (--port 70000)."""

from __future__ import annotations

import pytest

from irminsul.cli import build_parser
from irminsul.config import RouterConfig, ServerConfig


@pytest.mark.parametrize("argv", [
    ["bench", "--requests", "-1"],  # was prompts[:-1]: every request but the last
    ["bench", "--requests", "0"],  # was: the default workload built, then none replayed
    ["bench", "--slots", "0"],  # was: `args.slots or ...`, the default pool
    ["bench", "--slots", "-5"],
    ["consistency", "--requests", "-1"],
    ["consistency", "--slots", "0"],
    ["consistency", "--tokens", "0"],
    ["consistency", "--tokens", "-3"],
    ["workload", "agent_meta", "--out", "w.jsonl", "--requests", "-1"],
    ["demo", "--requests", "0"],
])
def test_counts_must_be_positive(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert argv[-2] in capsys.readouterr().err  # the option is named


@pytest.mark.parametrize("argv", [["bench", "--requests", "3", "--slots", "512"],
                                  ["consistency", "--requests", "1", "--tokens", "1"],
                                  ["workload", "agent_meta", "--out", "w.jsonl",
                                   "--requests", "1"]])
def test_positive_counts_still_parse(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.requests >= 1


@pytest.mark.parametrize("argv", [["serve", "--port", "70000"], ["serve", "--port", "-1"],
                                  ["router", "--backend", "http://a:1", "--port", "65536"]])
def test_port_out_of_range_is_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2


@pytest.mark.parametrize("port", [-1, 65536, 70000])
def test_config_port_out_of_range(port: int) -> None:
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=port)
    with pytest.raises(ValueError, match="port"):
        RouterConfig(port=port)
    ServerConfig(port=0)  # 0: any free port, as the socket API takes it
    RouterConfig(port=65535)
