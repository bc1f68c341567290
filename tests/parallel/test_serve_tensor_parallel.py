"""``irminsul serve --tensor-parallel 2`` as a user runs it: a real server process (rank 0) and its
follower process, on gloo over the CPU. On the embedded model (8 heads, 8 routed experts) it
answers as one process does (the same greedy text, PIC reuse included) and stops cleanly. On the
tiny chat model (4 heads, 8 experts; faster to start): a follower killed mid-request stops the
server with one error naming the rank, the request gets an error and the process exits with
status 1; a killed leader takes its follower with it. Bad values are refused before any rank
starts. Every wait here has a deadline: a hang fails the test."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fixtures.fp8_config import small_fp8_config
from fixtures.served_app import served
from fixtures.tiny_chat_model import sentences
from fixtures.tiny_server_model import build

from irminsul.cli import main
from irminsul.config import CacheConfig, EngineConfig, ServerConfig
from irminsul.loadgen.server import free_port
from irminsul.model import default_model_dir
from irminsul.parallel import ranks
from irminsul.server import build_server

START_S = 60.0  # two processes importing torch and loading the model on two shared cores
SHORT = [{"role": "user", "content": " ".join(sentences(2, seed=1))}]
SERVE = ["--device", "cpu", "--dtype", "float32", "--no-gate", "--pic", "live",
         "--slots", "2048", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("tiny-tp-model"))


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    log: Path

    def text(self) -> str:
        return self.log.read_text("utf-8", "replace")

    def followers(self) -> list[int]:
        """The follower pids the server logged at start."""
        return [int(pid) for pid in re.findall(r"rank \d+ of \d+ started \(pid (\d+)",
                                               self.text())]


def follower_alive(pid: int, module: str = "irminsul.parallel.follower") -> bool:
    """Whether ``pid`` is still a running (not zombie) process of ``module``'s (a follower)."""
    try:
        if module.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition, timeout: float, what: str) -> float:
    """Poll ``condition`` until it holds; the seconds it took. Fails after ``timeout``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout:g} s"
        time.sleep(0.05)
    return time.monotonic() - start


@contextlib.contextmanager
def tensor_parallel(model_dir: Path | None, log: Path, world: int = 2, *,
                    gate_cache: Path | None = None, extra: Sequence[str] = (),
                    split: str = "--tensor-parallel", ranks: int | None = None,
                    module: str = "irminsul.parallel.follower",
                    start_s: float = START_S) -> Iterator[Server]:
    """``irminsul serve --tensor-parallel world`` on a free port until the block ends; then the
    server and its followers (by the pids it logged) are killed if still running. With
    ``gate_cache`` the PIC gate runs (its results cached there), else ``--no-gate``; ``extra``:
    more flags (without ``model_dir``, no ``--model``). ``split``, ``ranks``, ``module``: another
    split's flag, the rank processes it starts (default ``world`` − 1) and their module."""
    port = free_port()
    flags = SERVE if gate_cache is None else [f for f in SERVE if f != "--no-gate"]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    if gate_cache is not None:
        env["XDG_CACHE_HOME"] = str(gate_cache)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "irminsul.cli", "serve",
             *(["--model", str(model_dir)] if model_dir is not None else []), *flags, *extra,
             split, str(world), "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(process, f"http://127.0.0.1:{port}", log)
    try:
        def ready() -> bool:
            assert process.poll() is None, f"the server exited:\n{server.text()[-3000:]}"
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(f"{server.url}/health", timeout=2).status_code == 200
            return False

        # The gate's three engines run on both ranks first: ~20 s of one CPU thread each.
        wait_until(ready, start_s * (1 if gate_cache is None else 3), "the server's /health")
        assert len(server.followers()) == (world - 1 if ranks is None else ranks), server.text()
        yield server
    finally:
        followers = server.followers()
        if process.poll() is None:
            process.kill()
            process.wait(10)
        for pid in followers:
            if follower_alive(pid, module):
                os.kill(pid, signal.SIGKILL)


def chats() -> list[list[dict]]:
    """A document, then the same document shifted behind other messages (PIC reuses it: the
    followers rotate their rows as the leader does), then a follow-up of the first."""
    doc = " ".join(sentences(40, seed=3))
    first = [{"role": "system", "content": " ".join(sentences(2, 4))},
             {"role": "user", "content": doc}, {"role": "user", "content": "Summarise."}]
    shifted = [{"role": "system", "content": " ".join(sentences(5, 5))},
               {"role": "user", "content": "Here is a file."},
               {"role": "user", "content": doc}, {"role": "user", "content": "Which gate?"}]
    return [first, shifted, first + [{"role": "assistant", "content": "Noon."},
                                     {"role": "user", "content": "And the evening one?"}]]


def answers(url: str) -> list[dict]:
    out = []
    for messages in chats():
        response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": messages, "max_tokens": 32, "temperature": 0})
        assert response.status_code == 200, response.text
        body = response.json()
        out.append(dict(text=body["choices"][0]["message"]["content"],
                        tokens=body["usage"]["completion_tokens"], **body["usage"]["irminsul"]))
    return out


def audited(url: str, count: int) -> tuple[int, float]:
    """The live-PIC audit's (count, KL sum) from /metrics once it has audited at least
    ``count`` requests and audits no more for a second (it runs when the engine is idle)."""
    def read() -> tuple[int, float]:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        figures = {name: float(value) for name, value in re.findall(
            r"^irminsul:pic_audit_kl_(count|sum)(?:\{[^}]*\})? (\S+)$", text, re.M)}
        return int(figures.get("count", 0)), figures.get("sum", 0.0)

    wait_until(lambda: read()[0] >= count, 30, f"{count} audited requests")
    while True:
        before = read()
        time.sleep(1.0)
        if read() == before:
            return before


def test_two_ranks_answer_as_one_process_and_stop_cleanly(tmp_path: Path, one_thread: None) -> None:
    """On the embedded model (8 heads, 8 routed experts, trained: its greedy text depends on the
    context, so followers that skipped their rotations change the shifted request's answer,
    checked by hand; the random tiny model's does not). The PIC gate runs first, on the ranks'
    shards (rank 0 never loads the whole model), and passes, as on one process. CacheBlend-style
    repair and the live-PIC audit run the model outside a batch: on every rank too, with the
    same tokens recomputed (the same text) and the same KL recorded as on one process."""
    model_dir = default_model_dir()
    config = ServerConfig(model_name="tiny", dtype="float32", device="cpu", gate=None,
                          engine=EngineConfig(mode="live", slots=2048, pic_audit_rate=1.0,
                                              cache=CacheConfig(recompute_share=0.1)))
    app, _ = build_server(model_dir, config)
    with served(app) as url:
        expected = answers(url)
        want = audited(url, 1)
    assert expected[1]["pic_cached_tokens"] > 100  # the shifted document was reused
    extra = ["--pic-audit-rate", "1", "--recompute-share", "0.1"]
    with tensor_parallel(model_dir, tmp_path / "serve.log", gate_cache=tmp_path,
                         extra=extra) as server:
        got = answers(server.url)
        # Two ranks add their partial outputs in another order: float32 rounding moves a KL of
        # ~6e-5 by ~1e-4 of itself (1.1e-4 in one CI run); a follower serving other rows than
        # rank 0 would move it by orders of magnitude.
        assert audited(server.url, want[0]) == pytest.approx(want, rel=1e-3, abs=1e-9)
        [follower] = server.followers()
        server.process.send_signal(signal.SIGINT)  # a normal stop
        assert server.process.wait(30) == 0, server.text()[-3000:]
        wait_until(lambda: not follower_alive(follower), 10, "the follower's exit")
    assert got == expected
    assert all(answer["tokens"] > 8 for answer in got)
    assert "stopped by the leader after" in server.text()
    assert "ERROR" not in server.text()
    assert "PIC gate passed" in server.text() and "(measured in" in server.text()
    assert "live (gate passed)" in server.text()  # the startup line
    assert len(re.findall(r"engine \d+ opened", server.text())) == 4  # the gate's 3, serving


def test_random_fp8_weights_serve_on_two_ranks(tmp_path: Path) -> None:
    """The benchmark-only server of an FP8 model's shapes (``--random-weights --keep-fp8``):
    each rank makes only its share, in float8; the two ranks serve a request to its length and
    stop cleanly."""
    path = small_fp8_config(tmp_path)
    flags = ["--random-weights", str(path), "--keep-fp8"]
    with tensor_parallel(None, tmp_path / "serve.log", extra=flags) as server:
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": SHORT, "max_tokens": 8, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(30) == 0, server.text()[-3000:]
    assert "gate skipped: random weights" in server.text()
    assert "ERROR" not in server.text()


def test_the_serving_benchmark_drives_a_tensor_parallel_fp8_server(tmp_path: Path) -> None:
    """The multi-GPU benchmark's command, CPU-sized: ``irminsul bench serve`` starts
    ``serve --tensor-parallel 2 --keep-fp8`` on random float8 shares, PIC off then live, and
    every call is answered; live serves prompt tokens from cache."""
    path = small_fp8_config(tmp_path)
    out = tmp_path / "bench.json"
    assert main(["-q", "bench", "serve", "--random-weights", str(path), "--device", "cpu",
                 "--server-args", "--tensor-parallel 2 --keep-fp8 --dtype float32",
                 "--sessions", "2", "--calls", "2", "--max-reply-tokens", "4", "--warmup", "0",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for mode in ("off", "live"):
        run = report["modes"][mode]
        assert (run["summary"]["calls"], run["summary"]["failed_calls"]) == (4, 0)
        assert f"PIC {mode}" in run["server"]["startup_line"]
    assert report["modes"]["live"]["summary"]["pic_cached_tokens"] > 0


def signal_mid_stream(server: Server, pid: int, sig: signal.Signals, *, timeout: float
                      ) -> tuple[list[str], float]:
    """Stream a long greedy reply and send ``sig`` to ``pid`` once its first content arrives;
    the stream's events to its end, and when the signal was sent."""
    events, sent = [], None
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=timeout, json={
            "model": "tiny", "messages": SHORT, "max_tokens": 1500,
            "temperature": 0, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
            if sent is None and '"content"' in line:  # mid-generation
                os.kill(pid, sig)
                sent = time.monotonic()
    assert sent is not None, events
    return events, sent


def test_a_killed_follower_stops_the_server_and_fails_the_request(model_dir: Path,
                                                                  tmp_path: Path) -> None:
    with tensor_parallel(model_dir, tmp_path / "serve.log") as server:
        [follower] = server.followers()
        events, killed = signal_mid_stream(server, follower, signal.SIGKILL, timeout=30)
        assert events[-1] == "[DONE]"
        assert '"error"' in events[-2] and "engine_error" in events[-2], events[-3:]
        assert sum('"content"' in event for event in events) < 1000  # cut short, not finished
        status = server.process.wait(30)
        elapsed = time.monotonic() - killed
        log = server.text()
        assert status == 1, log[-3000:]
        assert elapsed < 20, elapsed
        errors = [line for line in log.splitlines() if "ERROR irminsul.parallel.serving" in line]
        assert len(errors) == 1, errors
        assert f"rank 1 (pid {follower}) was killed by SIGKILL while" in errors[0]
        assert "Stopping the server" in errors[0]
        with pytest.raises(httpx.TransportError):  # the next request: refused, not left waiting
            httpx.post(f"{server.url}/v1/chat/completions", timeout=10,
                       json={"model": "tiny", "messages": SHORT, "max_tokens": 4})


def test_a_hung_follower_stops_the_server_after_the_collective_timeout(model_dir: Path,
                                                                       tmp_path: Path) -> None:
    """A follower stopped (SIGSTOP: alive, answering nothing) mid-stream: the leader's next
    collective waits ``--collective-timeout`` (3 s here) and fails; the stream ends with an
    error, the server logs one error naming the step and exits with status 1."""
    with tensor_parallel(model_dir, tmp_path / "serve.log",
                         extra=["--collective-timeout", "3"]) as server:
        [follower] = server.followers()
        try:
            events, stopped = signal_mid_stream(server, follower, signal.SIGSTOP, timeout=60)
            assert '"error"' in events[-2] and "engine_error" in events[-2], events[-3:]
            status = server.process.wait(60)
            elapsed = time.monotonic() - stopped
        finally:
            if follower_alive(follower):
                os.kill(follower, signal.SIGCONT)
        log = server.text()
        assert status == 1, log[-3000:]
        assert 3 <= elapsed < 45, elapsed  # the timeout, then the stop (5 s grace)
        errors = [line for line in log.splitlines() if "ERROR irminsul.parallel.serving" in line]
        assert len(errors) == 1, errors
        assert "did not answer within 3 s" in errors[0], errors[0]
        assert "Stopping the server" in errors[0]


def test_a_follower_killed_during_the_gate_stops_the_server(tmp_path: Path) -> None:
    """The PIC gate runs on the ranks' engines before serving: a follower killed while it runs
    them ends the server with status 1 and one error naming the rank and the startup step."""
    port, log = free_port(), tmp_path / "serve.log"
    flags = [f for f in SERVE if f != "--no-gate"]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "irminsul.cli", "serve", "--model", str(default_model_dir()),
             *flags, "--tensor-parallel", "2", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT,
            env=os.environ | {"PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": str(tmp_path)})
    server = Server(process, f"http://127.0.0.1:{port}", log)
    try:
        wait_until(lambda: "engine 1 opened" in server.text() or process.poll() is not None,
                   START_S, "the gate's second engine on the follower")
        [follower] = server.followers()
        os.kill(follower, signal.SIGKILL)
        assert process.wait(30) == 1, server.text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    errors = [line for line in server.text().splitlines()
              if "ERROR irminsul.parallel.serving" in line]
    assert len(errors) == 1, server.text()[-3000:]
    assert f"rank 1 (pid {follower}) was killed by SIGKILL" in errors[0]
    # The follower logs its engine opened before the leader's own open returns: under load the
    # kill can land while the leader still opens the gate's engine (the CI of 2026-12-02 saw it).
    assert ("running the PIC gate" in errors[0]
            or "opening an engine on the ranks" in errors[0]), errors[0]
    assert "Stopping the server" in errors[0]


@pytest.mark.parametrize("expert, rank", [(0, 0), (7, 1)])
def test_a_rank_failing_to_load_its_share_stops_the_server(model_dir: Path, tmp_path: Path,
                                                           expert: int, rank: int) -> None:
    """A checkpoint missing one expert (experts 0-3 are rank 0's of 2, 4-7 rank 1's): the rank
    that keeps it fails at startup, the other loads its share; the server exits with status 1,
    one error names the rank and the missing tensor, and the follower is gone."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = load_file(broken / "model.safetensors")
    missing = f"model.layers.1.mlp.experts.{expert}.down_proj.weight"
    del weights[missing]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "irminsul.cli", "serve", "--model", str(broken), *SERVE,
             "--tensor-parallel", "2", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    server = Server(process, f"http://127.0.0.1:{port}", log)
    try:
        assert process.wait(START_S) == 1, server.text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    [follower] = server.followers()
    wait_until(lambda: not follower_alive(follower), 10, "the follower's exit")
    errors = [line for line in server.text().splitlines()
              if "ERROR irminsul.parallel.serving" in line]
    assert len(errors) == 1, server.text()[-3000:]
    assert f"rank {rank}" in errors[0] and missing in errors[0], errors[0]


def test_followers_exit_when_the_leader_is_killed(model_dir: Path, tmp_path: Path) -> None:
    with tensor_parallel(model_dir, tmp_path / "serve.log") as server:
        [follower] = server.followers()
        server.process.kill()
        server.process.wait(10)
        wait_until(lambda: not follower_alive(follower), 10, "the orphaned follower's exit")
    # Whichever saw it first: the leader's pipe closing, or the control group's connection.
    assert re.search(r"ERROR irminsul rank 1: (the leader's process ended|rank 1 failed while "
                     r"following the leader's steps: RankFailure)", server.text()), server.text()


@pytest.mark.parametrize("argv, needle", [
    (["--tensor-parallel", "3"], "--tensor-parallel 3 does not fit"),
    (["--tensor-parallel", "2", "--recompute-share", "0.1", "--recompute-rule", "signed"],
     "--recompute-rule signed does not run under --tensor-parallel"),
])
def test_bad_tensor_parallel_options_are_refused_before_any_rank_starts(
        argv: list[str], needle: str, model_dir: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def start(*_: object) -> None:
        raise AssertionError("a follower was started")

    monkeypatch.setattr(ranks.Followers, "start", start)
    assert main(["serve", "--model", str(model_dir), "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err, err
    if "does not fit" in needle:
        assert "num_attention_heads (4) does not split evenly over 3 ranks" in err


@pytest.mark.parametrize("value, needle", [("0", "must be >= 1"), ("-2", "must be >= 1"),
                                           ("two", "must be a whole number")])
def test_tensor_parallel_must_be_a_positive_count(value: str, needle: str,
                                                  capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--tensor-parallel", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel" in err and needle in err, err
