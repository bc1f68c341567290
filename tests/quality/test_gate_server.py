"""A live server runs the gate before it serves: a refused checkpoint is served with exact
prefixes only, says so in its log, its startup line and /metrics; a passing one serves live PIC;
``--no-gate`` and random weights serve live without it, each saying why."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import pytest
from fixtures.served_app import served

from irminsul.cli import main
from irminsul.config import EngineConfig, GateConfig, ServerConfig
from irminsul.model.default import default_model_dir
from irminsul.quality import GateResult, gate_probes
from irminsul.server import build_server

NAME = "gated"


def config(gate: GateConfig | None, mode: str = "live") -> ServerConfig:
    return ServerConfig(model_name=NAME, dtype="float32", device="cpu", gate=gate,
                        engine=EngineConfig(mode=mode, slots=8192))


def metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def pic_tokens_of_a_moved_document(base: str) -> int:
    """Serve the first probe (records re-ranked behind a new one): the moved request's prompt
    tokens served by PIC."""
    probe = gate_probes()[0]
    served_by_pic = []
    for request in (probe.seen, probe.moved):
        response = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": NAME, "messages": request.messages, "max_tokens": 1})
        response.raise_for_status()
        served_by_pic.append(response.json()["usage"]["irminsul"]["pic_cached_tokens"])
    return served_by_pic[1]


def messages(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def startup(caplog: pytest.LogCaptureFixture) -> str:
    (line,) = [m for m in messages(caplog) if " as model id " in m]
    return line


def test_a_refused_checkpoint_serves_exact_prefixes_only(
        unsafe_dir: Path, gate_config: GateConfig, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="irminsul"):
        app, engine = build_server(unsafe_dir, config(gate_config))
    assert engine.scheduler.engine.config.mode == "off"
    (warning,) = [m for m in messages(caplog, logging.WARNING) if "PIC gate" in m]
    assert "refused live reuse" in warning and "exceeds the threshold" in warning
    assert "serving exact prefixes only (PIC off)" in warning
    assert "| PIC off (gate refused live) |" in startup(caplog)
    with served(app) as base:
        text = httpx.get(f"{base}/metrics").text
        assert metric(text, "irminsul:pic_gate_passed") == 0
        assert metric(text, 'irminsul:pic_gate_kl{path="pic"}') > gate_config.max_kl
        assert metric(text, 'irminsul:pic_gate_kl{path="naive"}') > 0
        assert pic_tokens_of_a_moved_document(base) == 0


def test_a_passing_checkpoint_serves_live(default_result: GateResult, gate_config: GateConfig,
                                          caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="irminsul"):
        app, engine = build_server(default_model_dir(), config(gate_config))
    assert engine.scheduler.engine.config.mode == "live"
    assert any("PIC gate passed" in m and "cached result" in m for m in messages(caplog))
    assert "| PIC live (gate passed) |" in startup(caplog)
    with served(app) as base:
        text = httpx.get(f"{base}/metrics").text
        assert metric(text, "irminsul:pic_gate_passed") == 1
        assert metric(text, 'irminsul:pic_gate_kl{path="pic"}') == pytest.approx(
            default_result.kl_pic)
        assert metric(text, "irminsul:pic_gate_argmax_match") == pytest.approx(
            default_result.argmax)
        assert pic_tokens_of_a_moved_document(base) > 0


def test_no_gate_serves_live_and_warns(unsafe_dir: Path, measurements,
                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="irminsul"):
        app, engine = build_server(unsafe_dir, config(None))
    assert engine.scheduler.engine.config.mode == "live" and measurements() == 0
    (warning,) = [m for m in messages(caplog, logging.WARNING) if "PIC gate" in m]
    assert "disabled by the operator (--no-gate)" in warning
    assert "| PIC live (gate off) |" in startup(caplog)
    with served(app) as base:
        assert "pic_gate" not in httpx.get(f"{base}/metrics").text


def test_random_weights_skip_the_gate(gate_config: GateConfig, measurements,
                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="irminsul"):
        _, engine = build_server(default_model_dir(), config(gate_config),
                                 random_weights=default_model_dir() / "config.json")
    assert engine.scheduler.engine.config.mode == "live" and measurements() == 0
    assert any("PIC gate skipped: random weights" in m for m in messages(caplog))
    assert "| PIC live (gate skipped: random weights) |" in startup(caplog)


@pytest.mark.parametrize("mode", ["off", "observer"])
def test_modes_without_reuse_run_no_gate(mode: str, unsafe_dir: Path, gate_config: GateConfig,
                                         measurements, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="irminsul"):
        _, engine = build_server(unsafe_dir, config(gate_config, mode))
    assert engine.scheduler.engine.config.mode == mode and measurements() == 0
    assert f"| PIC {mode} |" in startup(caplog)
    assert not [m for m in messages(caplog, logging.WARNING) if "PIC gate" in m]


def test_serve_no_gate_option(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ServerConfig] = []
    monkeypatch.setattr("irminsul.server.serve",
                        lambda model_dir, server_config, **_: seen.append(server_config))
    assert main(["serve"]) == 0 and main(["serve", "--no-gate"]) == 0
    assert seen[0].gate == GateConfig() and seen[1].gate is None
