"""How the ranks of a parallel server start and stop, where the way they do it used to fail: a
terminal's Ctrl-C (SIGINT to the whole process group), ranks that start or load at different
speeds, a router whose port is taken, and a normal stop while the engine thread is still inside
a step. Servers run as a user runs them (processes on gloo over the CPU); slow ranks are made
slow by tests/parallel/slow_rank/sitecustomize.py, on the ranks' PYTHONPATH."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fixtures.tiny_server_model import build
from tiny_parallel import tiny_model

from irminsul.config import EngineConfig, ParallelConfig
from irminsul.engine import Engine, SamplingParams, Scheduler
from irminsul.engine.model_runner import ModelRunner
from irminsul.loadgen.server import free_port
from irminsul.parallel import serving, shard_weights
from irminsul.server.async_engine import AsyncEngine

HOOK = str(Path(__file__).parent / "slow_rank")
SERVE = ["--device", "cpu", "--dtype", "float32", "--no-gate", "--pic", "live",
         "--slots", "2048", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("tiny-tp-model"))


def _start(args: list[str], log: Path, **env: str) -> subprocess.Popen:
    """``irminsul serve ARGS`` in a session of its own (a shell job: its group the terminal's)."""
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "irminsul.cli", "serve", *SERVE, *args],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=os.environ | {"PYTHONUNBUFFERED": "1"} | env)


def _wait_healthy(process: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)


def _answers(port: int) -> None:
    response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hello there."}],
        "max_tokens": 4})
    assert response.status_code == 200, response.text


def _slow_rank(**env: str) -> dict[str, str]:
    return env | {"PYTHONPATH": os.pathsep.join([HOOK, *filter(None, [os.environ.get(
        "PYTHONPATH")])])}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_every_process_is_a_normal_stop(model_dir: Path, tmp_path: Path,
                                                     sig: signal.Signals) -> None:
    """A terminal's Ctrl-C sends SIGINT to the foreground process group, systemd's stop SIGTERM
    to every process of the service: followers used to get it too, mid-broadcast, and the
    server exited 1 with an error. They now stop only when the leader releases them."""
    port, log = free_port(), tmp_path / "serve.log"
    process = _start(["--model", str(model_dir), "--tensor-parallel", "2",
                      "--host", "127.0.0.1", "--port", str(port)], log)
    try:
        _wait_healthy(process, port, log)
        for pid in [process.pid, *_children(process.pid)]:  # every process, as systemd does
            os.kill(pid, sig)
        status = process.wait(90)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text("utf-8", "replace")
    assert status == 0 and "ERROR" not in text, text[-3000:]


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_follower_slower_to_start_than_the_collective_timeout(model_dir: Path,
                                                                tmp_path: Path) -> None:
    """The group's rendezvous used to wait only the collective timeout for every rank."""
    port, log = free_port(), tmp_path / "serve.log"
    process = _start(["--model", str(model_dir), "--tensor-parallel", "2",
                      "--collective-timeout", "3", "--host", "127.0.0.1", "--port", str(port)],
                     log, **_slow_rank(IRMINSUL_TEST_SLOW_START_S="6"))
    try:
        _wait_healthy(process, port, log)
        _answers(port)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def test_a_rank_loading_slower_than_the_collective_timeout_still_starts(tmp_path: Path) -> None:
    """Under data parallel the rank ready first used to start its lockstep turns at once, and
    its first all-reduce gave up on the slower rank after the collective timeout."""
    port, log = free_port(), tmp_path / "serve.log"
    process = _start(["--data-parallel", "2", "--collective-timeout", "3",
                      "--host", "127.0.0.1", "--port", str(port)],
                     log, **_slow_rank(IRMINSUL_TEST_SLOW_LOAD_S="8"))
    try:
        _wait_healthy(process, port, log)
        _answers(port)
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0, log.read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert "ERROR" not in log.read_text("utf-8", "replace")


def test_a_router_port_in_use_stops_the_ranks_and_cleans_up(tmp_path: Path) -> None:
    """uvicorn's SystemExit used to skip stopping the ranks: they died only when their pipes
    closed, and their report directory was left behind."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    log = tmp_path / "serve.log"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        process = _start(["--data-parallel", "2", "--host", "127.0.0.1",
                          "--port", str(taken.getsockname()[1])], log, TMPDIR=str(tmpdir))
        try:
            status = process.wait(180)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text("utf-8", "replace")
    assert status != 0, text[-3000:]
    assert not glob.glob(str(tmpdir / "irminsul-ranks-*"))
    assert "the leader's process ended" not in text, text[-1500:]  # stopped, not orphaned


IN_STEP, FINISH_STEP = threading.Event(), threading.Event()


class _SlowRunner(ModelRunner):
    """A forward that outlasts the engine's shutdown join (a long step)."""

    def forward(self, batch, *, all_logits=False):  # noqa: ANN001,ANN201
        IN_STEP.set()
        FINISH_STEP.wait(30)
        return super().forward(batch, all_logits=all_logits)


class _Followers:
    """Follower processes that stop as soon as they are released."""

    def exited(self) -> list:
        return []

    def running(self) -> list:
        return []

    def wait(self, timeout_s: float) -> bool:
        return True

    def kill(self) -> None:
        pass

    def close(self) -> None:
        pass


class _LeaderRunner:
    """Records whether the followers were released while the engine thread was mid-step."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.released_mid_step: bool | None = None

    def stop(self, error: BaseException | None = None) -> None:
        self.released_mid_step = not self.engine.join(0) and not FINISH_STEP.is_set()


def test_close_does_not_release_the_followers_while_a_step_runs(monkeypatch) -> None:  # noqa: ANN001
    """The stop used to test ``AsyncEngine.alive``, False as soon as shutdown was asked, so a
    step still running past shutdown's join had a STOP broadcast across its collectives."""
    class Ended(SystemExit):
        pass

    def abort(code: int = 1):  # noqa: ANN202
        raise Ended(code)

    monkeypatch.setattr(serving, "abort", abort)  # not os._exit in the test process
    model = tiny_model("v2_lite_like", layers=2, seed=4)
    engine = AsyncEngine(Scheduler(Engine(model, EngineConfig(mode="live", slots=512),
                                          runner=_SlowRunner)))
    engine.start()

    async def submit() -> None:
        await engine.submit(np.arange(20), SamplingParams(max_tokens=2))

    asyncio.run(submit())
    assert IN_STEP.wait(30)
    leader = serving.Leader(ParallelConfig(world_size=2), _Followers())
    runner = _LeaderRunner(engine)
    leader._runner = lambda: runner
    leader.serving(engine, lambda: None)
    leader._watcher.start()
    try:
        engine.shutdown(timeout=0.2)  # the lifespan's join timed out: the step still runs
        assert not engine.join(0)
        threading.Timer(1.0, FINISH_STEP.set).start()  # the step ends a second later
        with contextlib.suppress(Ended):  # ending as after a failure would do too
            leader.close()
        assert runner.released_mid_step is not True, "STOP broadcast mid-step"
    finally:
        FINISH_STEP.set()
        engine.join(30)
        leader._closing = True
        leader._wake.set()


@pytest.mark.parametrize("attention", ["tensor", "data"])
@pytest.mark.parametrize("rank", [2, -1])
def test_a_rank_outside_the_world_is_refused(rank: int, attention: str) -> None:
    with pytest.raises(ValueError, match="rank"):
        shard_weights(tiny_model("v2_lite_like", layers=2), rank, 2, attention)
