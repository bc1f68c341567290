"""``irminsul serve --data-parallel 2`` as a user runs it: this process starts two rank servers (gloo
over the CPU) and routes requests to them. On the embedded model the PIC gate passes on both
ranks, run in step; a conversation sent through the router lands on one rank and gets one
process's greedy text and reuse; SIGINT stops everything with status 0. A rank killed stops the
server with one error naming it and status 1. Bad values are refused before any rank starts.
Every wait has a deadline: a hang fails the test."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from fixtures.fp8_config import small_fp8_config
from fixtures.served_app import served
from test_serve_tensor_parallel import chats, follower_alive, tensor_parallel, wait_until

from irminsul.cli import main
from irminsul.config import EngineConfig, ServerConfig
from irminsul.model import default_model_dir
from irminsul.parallel.data_serving import front_router
from irminsul.router.app import build_router
from irminsul.server import build_server

RANK = "irminsul.parallel.rank_server"


def data_parallel(log: Path, gate_cache: Path | None, extra: tuple[str, ...] = ()):  # noqa: ANN201
    """``irminsul serve --data-parallel 2`` on the embedded model until the block ends (then
    killed, with its ranks, if still running)."""
    return tensor_parallel(None, log, 2, gate_cache=gate_cache, split="--data-parallel",
                           ranks=2, module=RANK, start_s=90.0, extra=extra)


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
    with served(app) as url:
        expected = conversation(url)
    assert expected[1]["pic_cached_tokens"] > 100  # the shifted document was reused
    with data_parallel(tmp_path / "serve.log", gate_cache=tmp_path) as server:
        got = conversation(server.url)
        pids = server.followers()
        server.process.send_signal(signal.SIGINT)  # a normal stop
        assert server.process.wait(60) == 0, server.text()[-3000:]
        wait_until(lambda: not any(follower_alive(pid, RANK) for pid in pids), 10, "the ranks' exit")
    assert len({answer.pop("backend") for answer in got}) == 1, got
    for answer in expected:
        answer.pop("backend")
    assert got == expected
    text = server.text()
    assert "ERROR" not in text, text[-3000:]
    assert text.count("PIC gate passed") == 2 and "(measured in" in text  # on each rank
    assert "rank 0 stopped" in text and "rank 1 stopped" in text


def test_the_front_router_reads_the_ranks_indexes_under_an_index_token() -> None:
    """``--index-token`` under ``--data-parallel``: every rank server (the user's config with
    its own address) answers /irminsul/index only to the token's bearer, so the router in front
    must send it. A router without it gets 401 on every poll, marks every rank down, and the
    server answers nothing but 503."""
    config = ServerConfig(model_name="tiny", dtype="float32", device="cpu", gate=None,
                          engine=EngineConfig(mode="live", slots=512), index_token="secret")
    app, _ = build_server(default_model_dir(), config)  # a rank: the token as the user gave it
    with served(app) as rank:
        front = dataclasses.replace(front_router(config, [rank]), poll_interval_s=0.05)
        with served(build_router(front, default_model_dir())) as url:
            deadline = time.monotonic() + 20
            while True:  # until the first poll has landed, either way
                (state,) = httpx.get(f"{url}/irminsul/backends").json()["backends"]
                if state["index"]["generation"] is not None or state["failures"]:
                    break
                assert time.monotonic() < deadline, state
                time.sleep(0.02)
    assert state["up"] and not state["failures"], state


def test_a_killed_rank_stops_the_server(tmp_path: Path) -> None:
    with data_parallel(tmp_path / "serve.log", gate_cache=None) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": chats()[0], "max_tokens": 4})
        assert response.status_code == 200, response.text
        victim = server.followers()[1]
        os.kill(victim, signal.SIGKILL)
        assert server.process.wait(60) == 1, server.text()[-3000:]
    errors = [line for line in server.text().splitlines()
              if line.startswith("ERROR irminsul.parallel.data_serving")]
    assert len(errors) == 1, server.text()[-3000:]
    assert f"rank 1 (pid {victim}) was killed by SIGKILL" in errors[0]
    assert "Stopping the server" in errors[0]


def test_a_hung_rank_stops_the_server_after_the_collective_timeout(tmp_path: Path) -> None:
    """A rank stopped (SIGSTOP: alive, answering nothing) while the server is idle: the other
    rank's next turn waits ``--collective-timeout`` (3 s) and fails; that rank ends, and the
    server exits with status 1, naming it."""
    with data_parallel(tmp_path / "serve.log", gate_cache=None,
                       extra=("--collective-timeout", "3")) as server:
        hung = server.followers()[1]
        os.kill(hung, signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert server.process.wait(60) == 1, server.text()[-3000:]
            elapsed = time.monotonic() - started
        finally:
            with contextlib.suppress(ProcessLookupError):  # the server killed it
                os.kill(hung, signal.SIGCONT)
    errors = [line for line in server.text().splitlines()
              if line.startswith("ERROR irminsul.parallel.data_serving")]
    assert len(errors) == 1, server.text()[-3000:]
    assert "rank 0" in errors[0] and "did not answer within 3 s" in errors[0], errors[0]
    assert 3 <= elapsed < 30, elapsed


@pytest.mark.parametrize("flags, message", [
    (["--data-parallel", "3"], "--data-parallel 3 does not fit .*: n_routed_experts \\(8\\) "
                               "does not split evenly over 3 ranks"),
    (["--data-parallel", "2", "--tensor-parallel", "2"], "give one of them"),
    (["--data-parallel", "2", "--store", "redis://127.0.0.1:1"],
     "--store under --data-parallel needs --store-model-id"),
])
def test_bad_splits_are_refused_before_any_rank_starts(flags: list[str], message: str,
                                                       capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--device", "cpu", "--no-gate", *flags]) == 2
    assert re.search(message, capsys.readouterr().err), message


def test_the_serving_benchmark_drives_a_data_parallel_fp8_server(tmp_path: Path) -> None:
    """The multi-GPU benchmark's command, CPU-sized: ``irminsul bench serve`` starts ``serve
    --data-parallel 2 --keep-fp8`` on random float8 shares behind the router, PIC off then
    live; every call is answered (the first concurrent ones through the router included) and
    live serves prompt tokens from cache."""
    path = small_fp8_config(tmp_path)
    out = tmp_path / "bench.json"
    assert main(["-q", "bench", "serve", "--random-weights", str(path), "--device", "cpu",
                 "--server-args", "--data-parallel 2 --keep-fp8 --dtype float32",
                 "--sessions", "2", "--calls", "2", "--max-reply-tokens", "4", "--warmup", "0",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for mode in ("off", "live"):
        run = report["modes"][mode]
        assert (run["summary"]["calls"], run["summary"]["failed_calls"]) == (4, 0), run["calls"]
        assert f"PIC {mode}" in run["server"]["startup_line"]
    assert report["modes"]["live"]["summary"]["pic_cached_tokens"] > 0
