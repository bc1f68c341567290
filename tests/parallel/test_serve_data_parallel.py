"""``irminsul serve --data-parallel 2`` as a user runs it: this process starts two rank servers (gloo
over the CPU) and routes requests to them. On the embedded model the PIC gate passes on both
ranks, run in step; a conversation sent through the router lands on one rank and gets one
process's greedy text and reuse; SIGINT stops everything with status 0. A rank killed stops the
server with one error naming it and status 1. Bad values are refused before any rank starts.
Every wait has a deadline: a hang fails the test."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_serve_tensor_parallel import SERVE, Server, chats, wait_until

from irminsul.cli import main
from irminsul.config import EngineConfig, ServerConfig
from irminsul.loadgen.server import free_port
from irminsul.model import default_model_dir
from irminsul.server import build_server

START_S = 180.0  # two ranks importing torch, loading and running the gate in step on 2 cores


def rank_pids(server: Server) -> list[int]:
    return [int(pid) for pid in re.findall(r"data parallel: rank \d+ of \d+ started \(pid (\d+)",
                                           server.text())]


def alive(pid: int) -> bool:
    try:
        if b"irminsul.parallel.rank_server" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def data_parallel(log: Path, gate_cache: Path | None) -> Iterator[Server]:
    port = free_port()
    flags = SERVE if gate_cache is None else [f for f in SERVE if f != "--no-gate"]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    if gate_cache is not None:
        env["XDG_CACHE_HOME"] = str(gate_cache)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "irminsul.cli", "serve", *flags, "--data-parallel", "2",
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(process, f"http://127.0.0.1:{port}", log)
    try:
        def ready() -> bool:
            assert process.poll() is None, f"the server exited:\n{server.text()[-3000:]}"
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(f"{server.url}/health", timeout=2).status_code == 200
            return False

        wait_until(ready, START_S, "the router's /health")
        assert len(rank_pids(server)) == 2, server.text()
        yield server
    finally:
        pids = rank_pids(server)
        if process.poll() is None:
            process.kill()
            process.wait(10)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def conversation(url: str) -> list[dict]:
    """chats(): a document, the document shifted (PIC), a follow-up; one session."""
    out = []
    for messages in chats():
        response = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                              headers={"x-session-id": "agent-1"}, json={
                                  "model": "tiny", "messages": messages, "max_tokens": 32,
                                  "temperature": 0})
        assert response.status_code == 200, response.text
        body = response.json()
        out.append(dict(text=body["choices"][0]["message"]["content"],
                        tokens=body["usage"]["completion_tokens"], **body["usage"]["irminsul"],
                        backend=response.headers.get("x-irminsul-backend")))
    return out


def test_two_rank_servers_answer_as_one_process_and_stop_cleanly(tmp_path: Path,
                                                                  one_thread: None) -> None:
    """The embedded model (8 routed experts: 4 a rank). The conversation stays on one rank (the
    router's session and content policy), whose engine serves it as one process's does: the
    same greedy text, the same tokens reused by PIC — its MoE layers exchanging tokens with the
    other rank at every step, and the other rank taking its turns."""
    config = ServerConfig(model_name="tiny", dtype="float32", device="cpu", gate=None,
                          engine=EngineConfig(mode="live", slots=2048))
    app, _ = build_server(default_model_dir(), config)
    from fixtures.served_app import served

    with served(app) as url:
        expected = conversation(url)
    assert expected[1]["pic_cached_tokens"] > 100  # the shifted document was reused
    with data_parallel(tmp_path / "serve.log", gate_cache=tmp_path) as server:
        got = conversation(server.url)
        pids = rank_pids(server)
        server.process.send_signal(signal.SIGINT)  # a normal stop
        assert server.process.wait(60) == 0, server.text()[-3000:]
        wait_until(lambda: not any(alive(pid) for pid in pids), 10, "the ranks' exit")
    assert len({answer.pop("backend") for answer in got}) == 1, got
    for answer in expected:
        answer.pop("backend")
    assert got == expected
    text = server.text()
    assert "ERROR" not in text, text[-3000:]
    assert text.count("PIC gate passed") == 2 and "(measured in" in text  # on each rank
    assert "rank 0 stopped" in text and "rank 1 stopped" in text


def test_a_killed_rank_stops_the_server(tmp_path: Path) -> None:
    with data_parallel(tmp_path / "serve.log", gate_cache=None) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": chats()[0], "max_tokens": 4})
        assert response.status_code == 200, response.text
        victim = rank_pids(server)[1]
        os.kill(victim, signal.SIGKILL)
        assert server.process.wait(60) == 1, server.text()[-3000:]
    errors = [line for line in server.text().splitlines()
              if line.startswith("ERROR irminsul.parallel.data_serving")]
    assert len(errors) == 1, server.text()[-3000:]
    assert f"rank 1 (pid {victim}) was killed by SIGKILL" in errors[0]
    assert "Stopping the server" in errors[0]


@pytest.mark.parametrize("flags, message", [
    (["--data-parallel", "3"], "--data-parallel 3 does not fit .*: n_routed_experts \\(8\\) "
                               "does not split evenly over 3 ranks"),
    (["--data-parallel", "2", "--tensor-parallel", "2"], "give one of them"),
])
def test_bad_splits_are_refused_before_any_rank_starts(flags: list[str], message: str,
                                                       capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--device", "cpu", "--no-gate", *flags]) == 2
    assert re.search(message, capsys.readouterr().err), message
