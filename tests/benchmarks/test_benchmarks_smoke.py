"""The GPU suite, run CI-sized on the CPU: its building blocks, its FLOP count, and the report
rendered from its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
# The benchmarks import each other as scripts do: the GPU suite's folder first, then the report;
# appended, so that no benchmark script shadows an installed package for the rest of the session.
sys.path += [str(ROOT / "benchmarks" / "gpu"), str(ROOT / "benchmarks")]

import energy  # noqa: E402
import report  # noqa: E402
import session_memory  # noqa: E402
from common import TINY, AgentText, build_model  # noqa: E402
from roofline import prefill_flops  # noqa: E402
from shift_prompts import PATTERNS, build_requests  # noqa: E402

from irminsul.model import parse_config  # noqa: E402


@pytest.fixture(scope="module")
def text() -> AgentText:
    return AgentText(TINY["vocab_size"])


def test_prefill_flops_hand_count() -> None:
    cfg = parse_config(TINY)  # d 64, 2 heads, nope 16 + rope 64, v 16, rank 32, 2 layers
    per_layer_attn = 64 * 2 * 80 + 64 * (32 + 64) + 32 * 2 * (16 + 16) + 2 * 16 * 64
    dense = 3 * 64 * 96  # layer 0
    moe = 64 * 8 + 3 * 64 * 24 * (1 + 2)  # layer 1: router, 1 shared + top-2 routed experts
    tokens, logits = 10, 1
    attention = 2 * (10 * 10 // 2) * 2 * (80 + 16)  # 2 layers, T²/2 pairs, 2 heads
    expected = 2 * (tokens * (2 * per_layer_attn + dense + moe) + logits * 64 * 512 + attention)
    assert prefill_flops(cfg, tokens, logits) == expected == 1_578_496


@pytest.mark.parametrize("pattern", PATTERNS)
def test_shift_requests(pattern: str, text: AgentText) -> None:
    requests = build_requests(pattern, text, 512, 6, header=40)
    for r in requests:
        assert r.prompt.size == 512
        assert r.resets == sorted(set(r.resets)) and all(0 < x < 512 for x in r.resets)
        assert all(0 <= s < e <= 512 for s, e in r.novel)
    # Requests differ but share content: the point of every pattern.
    assert not np.array_equal(requests[0].prompt, requests[1].prompt)
    if pattern != "rerank":  # rerank's novel documents run out once all have been seen
        assert all(r.novel for r in requests)


@pytest.mark.parametrize("pattern", ["agent_meta", "sysvar"])
def test_novel_spans_leave_out_a_prefix_an_earlier_request_shares(pattern: str,
                                                                   text: AgentText) -> None:
    """The ideal prefills no token that an exact-prefix cache holds at its position: each novel
    span starts at or after the longest prefix shared with an earlier request (a naive scan),
    and the request line's tokens after it are novel."""
    requests = build_requests(pattern, text, 512, 8, header=40)
    longest = []
    for j, r in enumerate(requests[1:], 1):
        shared = 0
        for earlier in requests[:j]:
            k = 0
            while k < 512 and earlier.prompt[k] == r.prompt[k]:
                k += 1
            shared = max(shared, k)
        assert r.novel and r.novel[0][0] == shared  # a new agent's request shares nothing
        longest.append(shared)
    assert max(longest) > 40  # the lines' common leading tokens: the cut moves past the header


def test_shift_requests_reject_a_header_longer_than_the_prompt(text: AgentText) -> None:
    with pytest.raises(ValueError, match="2000-token header .* 512-token prompt"):
        build_requests("agent_meta", text, 512, 2, header=2000)


def test_energy_zero_readings() -> None:
    out = energy.aggregate([0.0, 2.0, 0.0, 4.0, 3.0, 5.0, 1.0])
    assert out["zero_readings"] == 2 and out["reported"]
    assert out["mean_j"] == pytest.approx(3.0) and out["p50_j"] == 3.0
    assert not energy.aggregate([0.0, 1.0])["reported"]


def test_prefill_energy_with_a_fake_counter(text: AgentText) -> None:
    model = build_model("cpu", tiny=True)
    requests = build_requests("agent_meta", text, 256, 2 * 13 + 1, header=50)
    calls = iter(range(10**9))  # +1000 mJ per reading: 1 J per batch of 2 prefills

    out = energy.prefill_energy(model, requests, lambda: 1000.0 * next(calls), batch=2)
    for event in ("miss", "prefix hit", "PIC hit"):
        assert out[event]["readings"] == 10 and out[event]["reported"]
        assert out[event]["p50_j"] == pytest.approx(0.5)
    assert out["PIC hit"]["over_miss"] == pytest.approx(1.0)


def test_cpu_run_and_table(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "suite.py"), "--device", "cpu",
                    "--tiny", "--out", str(out)], check=True, cwd=ROOT, timeout=120,
                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    results = json.loads(out.read_text())
    assert {c["pattern"] for c in results["ttft"]} == set(PATTERNS)
    assert all(c["requests"] == 3 for c in results["ttft"])
    assert [m["sessions"] for m in results["memory"]] == [1, 2]
    table = report.suite_tables(results)
    assert "PIC-live TTFT" in table and "rerank" in table and "transformers" in table
    headline = report.headline_table(results).splitlines()
    assert len(headline) == 2 + 3 and all(line.count("|") == 8 for line in headline)
    (tmp_path / "results").mkdir()
    out.rename(tmp_path / "results" / "gpu-suite.json")
    page = report.performance(tmp_path / "results")
    assert page.startswith(report.GENERATED) and "## GPU suite" in page and "### Roofline" in page


def test_suite_refuses_to_extend_another_devices_file(tmp_path: Path) -> None:
    """--extend adds sections to a file of the same device only: the file names one device, so
    another GPU's sections would be labelled with this run's."""
    earlier = tmp_path / "h200.json"
    earlier.write_text(json.dumps({"device": "NVIDIA H200", "ttft": []}))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "suite.py"),
                          "--device", "cpu", "--tiny", "--sections", "memory", "--extend",
                          str(earlier), "--out", str(tmp_path / "out.json")], cwd=ROOT,
                         timeout=120, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert run.returncode != 0 and not (tmp_path / "out.json").exists()
    assert "ran on 'NVIDIA H200', this run on 'cpu'" in run.stderr


def test_cache_host_time_runs(tmp_path: Path) -> None:
    results = _run_benchmark("cache_host_time", "--lengths", "512", "--headers", "50", "--requests",
                             "3", "--warmup", "1", tmp_path=tmp_path, timeout=120)
    rows = results["phases_ms_p50"]
    assert [(r["pattern"], r["header_tokens"]) for r in rows] == [
        ("agent_meta", 50), ("sysvar", 50), ("rerank", 0)]
    assert all(r[p] > 0 for r in rows for p in ("plan", "advance (reuse, alloc)", "commit"))


def test_decode_host_time_runs(tmp_path: Path) -> None:
    """Every timed step took the graph input path and decoded one token per request."""
    results = _run_benchmark("decode_host_time", "--batches", "3", "--contexts", "64", "--steps", "3",
                             "--warmup", "1", tmp_path=tmp_path, timeout=120)
    cells = results["cells"]
    assert [(c["batch"], c["context"], c["steps"]) for c in cells] == [(3, 64, 3)]
    assert cells[0]["host_ms"] > 0


def test_tp_messages_runs(tmp_path: Path) -> None:
    """A decode step's message with mirrored keys carries each request's one new handle: the
    whole message's handles (3 × 65 × 8 bytes) are gone from it."""
    results = _run_benchmark("tp_messages", "--batch", "3", "--context", "64", "--steps", "3",
                             tmp_path=tmp_path)
    rows = results["rows"]
    assert rows["whole"]["bytes"] - rows["mirrored"]["bytes"] > 3 * 64 * 8
    assert rows["mirrored"]["first_bytes"] > rows["mirrored"]["bytes"]
    assert all(row["broadcast_ms"] > 0 for row in rows.values())


def test_tensor_parallel_suite_runs_on_float8_shares(tmp_path: Path) -> None:
    """benchmarks/gpu/tp_suite.py CPU-sized: two gloo ranks, random float8 shares of a small
    FP8 config cut to one layer; the floor counts only rank 0's experts (at most its 4 of 8 per
    layer); the TTFT cell serves the shared body through PIC."""
    from fixtures.fp8_config import small_fp8_config

    config = small_fp8_config(tmp_path)
    out = tmp_path / "tp.json"
    subprocess.run([sys.executable, "tp_suite.py", "--device", "cpu", "--world", "2",
                    "--config", str(config), "--layers", "2", "--keep-fp8", "--batches", "3",
                    "--contexts", "32", "--steps", "2", "--warmup", "1", "--lengths", "256",
                    "--requests", "2", "--ttft-warmup", "1", "--out", str(out)],
                   check=True, cwd=ROOT / "benchmarks" / "gpu", timeout=300,
                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    result = json.loads(out.read_text())
    assert (result["world"], result["keep_fp8"], result["layers"]) == (2, True, 2)
    [ttft] = result["ttft"]
    assert ttft["prompt_tokens"] == 256 and ttft["served"]["PIC live via PIC"] > 0.3, ttft
    [cell] = result["cells"]
    assert (cell["batch"], cell["context"]) == (3, 32) and cell["tokens_per_s"] > 0
    assert 0 < cell["experts_touched_per_layer"] <= 4


def test_data_parallel_suite_runs_on_float8_shares(tmp_path: Path) -> None:
    """The same suite under data-parallel attention: each rank its own requests on its lockstep
    engine, the experts split and reached by all-to-all; node throughput is both ranks'."""
    from fixtures.fp8_config import small_fp8_config

    config = small_fp8_config(tmp_path)
    out = tmp_path / "dp.json"
    subprocess.run([sys.executable, "tp_suite.py", "--device", "cpu", "--world", "2",
                    "--attention", "data", "--config", str(config), "--layers", "2",
                    "--keep-fp8", "--batches", "3", "--contexts", "32", "--steps", "2",
                    "--warmup", "1", "--lengths", "256", "--requests", "2", "--ttft-warmup", "1",
                    "--out", str(out)],
                   check=True, cwd=ROOT / "benchmarks" / "gpu", timeout=300,
                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    result = json.loads(out.read_text())
    assert (result["world"], result["attention"], result["layers"]) == (2, "data", 2)
    [ttft] = result["ttft"]
    assert ttft["served"]["PIC live via PIC"] > 0.3, ttft
    [cell] = result["cells"]
    assert cell["node_tokens_per_s"] == pytest.approx(2 * cell["tokens_per_s"])
    assert 0 < cell["experts_touched_per_layer"] <= 4


def test_repair_runs(tmp_path: Path) -> None:
    """k = 0 recomputes nothing; a k past every run recomputes every reused token and serves what
    full recomputation computes; r = 0.5 recomputes half (rounded down per prompt)."""
    result = _run_benchmark("repair", "--workloads", "agent_meta", "--requests", "3", "--heads", "0",
                            "100000", "--shares", "0.5", "--tokens", "2", tmp_path=tmp_path)
    (workload,) = result["workloads"]
    assert workload["requests_with_hits"] > 0
    none, every, half = workload["rows"]
    assert none["recomputed_share"] == 0.0
    assert every["recomputed_share"] == 1.0 and every["kl"] < 1e-6 and every["argmax"] == 1.0
    assert 0.45 < half["recomputed_share"] <= 0.5
    # With no reuse the engine computes what the reference computes, up to float32 noise.
    assert 0 <= workload["floor_kl"] < 1e-6


def test_argmax_margins_runs(tmp_path: Path) -> None:
    """Every flipped step is one of the steps counted, its margin one of the reference's; the
    study's own argmax match is one minus the flips' share."""
    result = _run_benchmark("argmax_margins", "--options", "default", "--workload", "rerank",
                            "--requests", "3", "--tokens", "4", tmp_path=tmp_path)
    [row] = result["rows"]
    assert row["steps"] > 0 and 0 <= row["flips_at_near_ties"] <= row["near_tie_steps"]
    assert row["flips"] == len(row["flip_margins"]) <= row["steps"]
    assert row["argmax_pic"] == pytest.approx(1 - row["flips"] / row["steps"])
    assert all(m >= 0 for m in row["flip_margins"])


def test_planner_quality_runs(tmp_path: Path) -> None:
    """Each planner option's consistency on a workload with reuse: PIC serves tokens, its KL
    is below naive reuse's, and turning the sub-windows off serves no more than the default."""
    result = _run_benchmark("planner_quality", "--options", "default", "no_s1", "--workloads",
                            "rerank", "--requests", "3", "--tokens", "2", tmp_path=tmp_path)
    rows = {row["option"]: row for row in result["rows"]}
    assert list(rows) == ["default", "no_s1"] and result["options"]["no_s1"] == {"s1": False}
    for row in rows.values():
        assert row["requests_with_hits"] > 0 and 0 <= row["argmax_pic"] <= 1
        assert 0 <= row["kl_pic"] < row["kl_naive"]
    assert 0 < rows["no_s1"]["pic_token_fraction"] <= rows["default"]["pic_token_fraction"]


def test_repair_oracles_run(tmp_path: Path) -> None:
    """Both oracle rankings and the emulated attended rule recompute the share they are given;
    at r = 1 they recompute every reused token and serve what full recomputation computes."""
    results = _run_benchmark("repair", "--workloads", "sysvar", "--requests", "3", "--heads", "0",
                             "--shares", "--oracle", "0.5", "1", "--attended", "0.5", "1",
                             "--tokens", "2", tmp_path=tmp_path, timeout=600)
    (workload,) = results["workloads"]
    assert workload["requests_with_hits"] > 0
    none, *oracles = workload["rows"]
    assert [(r["method"], r["recompute_share"]) for r in oracles] == [
        ("attended", 0.5), ("attended", 1.0), ("oracle", 0.5), ("oracle", 1.0),
        ("gradient", 0.5), ("gradient", 1.0)]
    assert none["kl"] > 1e-6
    for row in oracles:
        if row["recompute_share"] == 1.0:
            assert row["recomputed_share"] == 1.0 and row["kl"] < 1e-6
        else:
            assert 0.45 < row["recomputed_share"] <= 0.5


def test_kl_anatomy_runs(tmp_path: Path) -> None:
    """Request 0 is computed whole (KL at float32 noise); the stats add up to each prompt; the
    one-level replay exists from request 1 on."""
    result = _run_benchmark("kl_anatomy", "--workload", "agent_meta", "--requests", "3", "--tokens",
                            "2", tmp_path=tmp_path)
    first, *rest = result["rows"]
    assert first["session"]["kl"] < 1e-6 and "after_one" not in first
    assert all("after_one" in row for row in rest)
    for row in result["rows"]:
        s = row["session"]
        assert (s["prefix_tokens"] + s["derived_prefix_tokens"] + s["pic_tokens"]
                + s["prefilled_tokens"]) == s["prompt_tokens"]
        assert len(s["kl_steps"]) == 2
    assert result["means"]["requests_with_reuse"] > 0


def test_sessions_held_at_a_budget_hand_counted() -> None:
    """Sessions of a 64-token header and a shared 512-token body in the bytes of 1,920 full
    rows: exact prefixes hold 3 (1,920 // 576); live PIC with equal spaces also 3 (each session
    holds k_r for all its tokens); with 8 k_r slots per c_KV slot (1,080 c_KV slots) 1 + (1,080 -
    576) // 65 = 8 (each later session computes its header and the prompt's last token)."""
    budget = 1920 * sum(session_memory.ROW_BYTES.values())
    rows = session_memory.sessions_held(budget, [1, 8], body_tokens=512, header=64)
    assert [(r["mode"], r["ckv_slots"], r["kr_slots"], r["sessions"]) for r in rows] == [
        ("off", 1920, 1920, 3), ("live", 1920, 1920, 3), ("live", 1080, 8640, 8)]


def test_performance_page_is_generated_from_the_results() -> None:
    """docs/performance.md is what ``python benchmarks/report.py`` writes from docs/results/:
    rerun it after changing a result or the report."""
    assert (ROOT / "docs" / "performance.md").read_text(encoding="utf-8") == report.performance()


def _run_benchmark(name: str, *args: str, tmp_path: Path, timeout: int = 300,
                folder: str = "cpu") -> dict:
    """The results JSON of ``benchmarks/FOLDER/NAME.py ARGS --out F``, run as a user runs it."""
    out = tmp_path / f"{name}.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / folder / f"{name}.py"), *args,
                    "--out", str(out)], check=True, cwd=ROOT, timeout=timeout,
                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return json.loads(out.read_text())


def _script(name: str, *args: str, tmp_path: Path) -> dict:
    """A GPU benchmark's results JSON, run on the CPU with the tiny model."""
    return _run_benchmark(name, "--device", "cpu", "--tiny", *args, tmp_path=tmp_path, timeout=180,
                          folder="gpu")


def test_decode_steps_against_their_floor_run(tmp_path: Path) -> None:
    """The decode benchmark on the tiny model: every cell timed once per arm, in order, its
    floor counted from the model's own parameter bytes (hand-checked: KV rows are layers ×
    (rank + rope) × 4 bytes); each arm's settings recorded as given."""
    results = _script("decode", "--batches", "1", "4", "--contexts", "64", "--steps", "3",
                      "--warmup", "1", "--arms", "engine", "router.GEMV_PROGRAMS=16",
                      tmp_path=tmp_path)
    cells = results["cells"]
    assert [(c["batch"], c["context"], c["arm"]) for c in cells] == [
        (1, 64, "engine"), (1, 64, "router.GEMV_PROGRAMS=16"), (4, 64, "engine"),
        (4, 64, "router.GEMV_PROGRAMS=16")]
    assert results["arms"] == {"engine": {},
                               "router.GEMV_PROGRAMS=16": {"router.GEMV_PROGRAMS": 16}}
    layers, rank, rope = (TINY["num_hidden_layers"], TINY["kv_lora_rank"],
                          TINY["qk_rope_head_dim"])
    for c in cells:
        assert c["step_ms"] > 0 and c["floor_ms"] > 0
        rows = c["batch"] * (c["context"] + 1 + c["steps"])  # contexts, warm-up and timed steps
        assert c["bytes"]["kv"] == rows * layers * (rank + rope) * 4


def test_decode_arms_parse() -> None:
    """--arms: presets by name, switches as typed literals; a name that is no switch, or a
    value of another type than the switch's, is refused with the entry named."""
    import decode

    from irminsul.kernels import launch, router

    assert decode.parse_arm("shared-last")[1] == {"router.SHARED_FIRST": False}
    assert decode.parse_arm("launch.MODE=0,router.SHARED_FIRST=False") == (
        "launch.MODE=0,router.SHARED_FIRST=False",
        {"launch.MODE": 0, "router.SHARED_FIRST": False})
    assert launch.MODE == 1 and router.SHARED_FIRST  # parsing sets nothing
    for bad, says in [("warm-fast", "neither a preset"), ("router.NOPE=1", "router.NOPE"),
                      ("nomodule.X=1", "nomodule.X"), ("router.SHARED_FIRST=1", "is bool"),
                      ("launch.MODE=many", "is int")]:
        with pytest.raises(SystemExit, match=says):
            decode.parse_arm(bad)


def test_chunked_prefill_run(tmp_path: Path) -> None:
    """The chunk-size benchmark on the tiny model: a 256-token prompt takes ceil(256 / chunk)
    forwards alone, and under load its first token comes after the decoders' steps."""
    results = _script("chunked_prefill", "--prompt", "256", "--chunks", "64", "100", "256",
                      "--decoders", "2", "--context", "64", "--repeats", "1", tmp_path=tmp_path)
    cells = results["cells"]
    assert [c["chunk_tokens"] for c in cells] == [64, 100, 256]
    assert [c["batch_tokens"] for c in cells] == [2048, 2048, 2048]  # max(2048, chunk + 2)
    assert [c["alone"]["forwards"] for c in cells] == [4, 3, 1]
    for c in cells:
        assert c["alone"]["ttft_ms"] > 0 and c["load"]["ttft_ms"] > 0
        assert c["load"]["steps"] == c["alone"]["forwards"]  # one chunk per step, decodes beside


def test_replay_rule_runs(tmp_path: Path) -> None:
    """The whole-replay A/B on the tiny model: both rules serve every request and compute the
    same tokens (a rule changes only where a forward's attention runs); off a GPU there are no
    graphs, so neither replays whole."""
    results = _script("replay_rule", "--cells", "agent_meta:1024:200", "--requests", "4",
                      tmp_path=tmp_path)
    (cell,) = results["cells"]
    before, now = cell["before"]["requests"], cell["now"]["requests"]
    assert len(before) == len(now) == 6
    assert [r["computed"] for r in before] == [r["computed"] for r in now]
    assert before[0]["computed"] == 1024 and any(100 < r["computed"] < 1024 for r in before)
    assert not any(r["whole"] for r in before + now)
    assert cell["now"]["ms_p95"] >= cell["now"]["ms_p50"] > 0


def test_request_compiles_runs(tmp_path: Path) -> None:
    """The compile probe on the tiny model: every request of the cell served by both arms, the
    novel spans as shift_prompts counts them (rerank at 1024: the first request's documents are
    all new; nothing compiles on a CPU, where no Triton kernel runs)."""
    results = _script("request_compiles", "--lengths", "1024", "--requests", "4",
                      tmp_path=tmp_path)
    (cell,) = results["cells"]
    assert [r["request"] for r in cell["requests"]] == [0, 1, 2, 3]
    assert cell["requests"][0]["novel"] == 512  # 4 documents of 1024 // 8 tokens each
    for row in cell["requests"]:
        assert row["live"]["ms"] > 0 and row["ideal"]["ms"] > 0
        assert row["live"]["compiled"] == row["ideal"]["compiled"] == []
    section = report.request_compiles(results, "gpu-request-compiles.json")
    assert section[0] == "## GPU: Triton compiles on a request's clock"
    assert any(line.startswith("| 1K |") and "| 4 × 2 | 0 |" in line for line in section)


def test_break_even_run_and_rule(tmp_path: Path) -> None:
    import break_even

    results = _script("break_even", "--docs", "64", "512", "--header", "96", "--requests", "2",
                      tmp_path=tmp_path)
    assert [c["doc_tokens"] for c in results["cells"]] == [64, 512]
    assert results["cells"][1]["live"]["pic_tokens"] == 512  # the document, reused whole
    assert results["cells"][1]["off"]["pic_tokens"] == 0

    def cells(*diffs: float) -> list[dict]:
        return [{"doc_tokens": 16 << i, "live_minus_off_ms": d} for i, d in enumerate(diffs)]

    assert break_even.break_even(cells(1.0, -0.5, -2.0, -9.0)) == 32
    assert break_even.break_even(cells(-1.0, 2.0, -2.0)) == 64  # live must win from D on
    assert break_even.break_even(cells(1.0, 2.0)) is None


def test_repair_ttft_runs_every_setting(tmp_path: Path) -> None:
    """The repair TTFT benchmark on the tiny model: every setting timed, the body served by PIC
    only live, and each repair computing what its knob says instead (k tokens of each reused
    run for head k — agent_meta's body is one or two runs, its last chunk sometimes found in
    another request's copy, at another δ, every run longer than 16 tokens; floor(r · reused)
    for share r)."""
    results = _script("repair_ttft", "--tokens", "512", "--requests", "1", "--heads", "4", "16",
                      "--shares", "0.1", "--signed", "0.1", "--check-layers", "1",
                      "--threads", "1", tmp_path=tmp_path)
    rows = {s["setting"]: s for s in results["settings"]}
    assert list(rows) == ["off", "live", "head 4", "head 16", "share 10%", "signed 10% L1"]
    assert rows["signed 10% L1"]["recompute_rule"] == "signed"
    assert all(s["ttft_ms"] > 0 for s in rows.values())
    assert rows["off"]["pic_tokens"] == 0 and rows["off"]["recomputed_tokens"] is None
    live = rows["live"]["pic_tokens"]
    assert live > 400 and rows["live"]["recomputed_tokens"] == 0
    runs, left = divmod(rows["head 4"]["recomputed_tokens"], 4)
    assert runs in (1, 2) and left == 0
    assert rows["head 16"]["recomputed_tokens"] == 16 * runs
    # Repair picks among live's reused tokens only (the last token is computed anyway).
    for setting in ("share 10%", "signed 10% L1"):
        assert rows[setting]["recomputed_tokens"] == int(0.1 * live)
    for s in rows.values():
        if s["recomputed_tokens"] is not None:
            assert s["pic_tokens"] == live - s["recomputed_tokens"]


def test_moe_kernel_against_its_floor_runs(tmp_path: Path) -> None:
    """The MoE benchmark on the tiny experts (float32, the kernel under Triton's interpreter):
    both paths and the sweep timed, the fused kernel agreeing with the grouped GEMMs, the floor
    counted from the touched experts' bytes (each 3 × 24 × 64 float32 weights)."""
    results = _script("moe", "--tokens", "1", "5", "--sweep", "--repeats", "1", "--calls", "1",
                      tmp_path=tmp_path)
    cells = results["cells"]
    assert [c["tokens"] for c in cells] == [1, 5]
    for c in cells:
        assert c["weight_bytes"] == c["experts_touched"] * 3 * 24 * 64 * 4
        assert c["max_rel_diff"] < 1e-5
        assert all(c[k]["ms"] > 0 for k in ("grouped", "fused", "align"))
        assert sum(k.startswith("fused m") for k in c) >= 4  # the sweep's shapes


def test_repair_picks_runs(tmp_path: Path) -> None:
    """Every figure of the picks' analysis is a share in [0, 1], per request with reuse."""
    results = _run_benchmark("repair_picks", "--workload", "sysvar", "--requests", "2", "--tokens",
                             "2", tmp_path=tmp_path)
    rows = results["rows"]
    assert rows
    for row in rows:
        shares = [row["negative_share"], row["top_tenth_share_of_positive_effect"],
                  row["overlap_deviation_oracle"], *row["overlap_attention_per_layer"]]
        assert all(0 <= s <= 1 for s in shares), row


def test_audit_floor_is_zero_where_both_paths_are_the_same_arithmetic(tmp_path: Path) -> None:
    """On the CPU (float32, no kernels) a request served with nothing reused and either
    reference's recompute of it are the same arithmetic: the floor is 0 to float noise."""
    results = _run_benchmark("audit_floor", "--device", "cpu", "--models", "default",
                             "--lengths", "64", "--prompts", "2", tmp_path=tmp_path,
                             timeout=180, folder="gpu")
    (cell,) = results["cells"]
    assert (cell["model"], cell["prompt_tokens"], cell["prompts"]) == ("default", 64, 2)
    assert cell["plain"]["kl_max"] < 1e-9 and cell["pool"]["kl_max"] < 1e-9
