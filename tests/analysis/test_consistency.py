"""Output consistency (``irminsul consistency``): PIC and naive reuse against full recomputation.

In a one-layer model a token's latent row depends on the token and its position only, so PIC
(shared c_KV, k_r rotated by δ) must reproduce full recomputation up to float noise while naive
reuse (k_r unrotated) must not. With two layers a reused row misses the attention to the context
it lands in, so PIC is only approximate; there the figures are recorded, not ordered.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fixtures.tiny_chat_model import build, workload

from irminsul.analysis.consistency import consistency, render_consistency
from irminsul.cli import main
from irminsul.model import load_model
from irminsul.traffic.logs import read_requests, write_requests
from irminsul.traffic.render import ChatRenderer

N = 12
KEYS = ("kl_pic", "kl_naive", "argmax_pic", "argmax_naive", "first_divergence_pic",
        "first_divergence_naive", "requests", "requests_with_hits", "pic_token_fraction")


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("log") / "chat.jsonl"
    write_requests(path, workload())
    return path


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("one_layer"), layers=1)


def _run(model_dir: Path, log: Path, **kwargs) -> dict:
    model = load_model(model_dir)
    return consistency(model, ChatRenderer.from_dir(model_dir), read_requests(log), tokens=N,
                       **kwargs)


def test_one_layer_pic_is_exact_and_naive_is_not(one_layer: Path, log: Path) -> None:
    report = _run(one_layer, log)
    assert set(KEYS) <= report.keys()
    assert report["requests"] == len(workload())
    assert report["requests_with_hits"] >= 3  # reordered documents and the marked region
    assert report["pic_token_fraction"] > 0.1
    for suffix in ("", "_all"):
        assert report[f"kl_pic{suffix}"] <= 1e-9
        assert report[f"argmax_pic{suffix}"] == 1.0
        assert report[f"first_divergence_pic{suffix}"] == N
    assert report["kl_naive"] > 1e-8
    assert report["kl_naive"] > 1e3 * max(report["kl_pic"], 1e-12)
    # Requests without hits are served identically on both engines.
    for row in report["per_request"]:
        if not (row["pic"]["pic_tokens"] or row["naive"]["pic_tokens"]):
            assert row["naive"]["kl"] <= 1e-9
    assert "naive reuse" in render_consistency(report)
    # Flips: the steps whose argmax differs, with the reference's lead at each, against the
    # per-request argmax match (exact PIC: none; naive reuse: as many as it missed).
    for row in report["per_request"]:
        assert row["pic"]["flips"] == []
        naive = row["naive"]
        assert len(naive["reference_margins"]) == N and min(naive["reference_margins"]) >= 0
        assert len(naive["flips"]) == round((1 - naive["argmax"]) * N)
        for step, margin in naive["flips"]:
            assert margin == naive["reference_margins"][step]


def test_two_layers_is_finite(tmp_path: Path, log: Path) -> None:
    report = _run(build(tmp_path, layers=2), log)
    assert report["requests_with_hits"] >= 3
    for key in ("kl_pic", "kl_naive", "kl_pic_all", "kl_naive_all"):
        assert math.isfinite(report[key]) and report[key] >= 0
    assert 0 <= report["argmax_pic"] <= 1 and 0 <= report["first_divergence_pic"] <= N
    # Random weights: no ordering is asserted; the figures are printed for the record.
    print({key: report[key] for key in KEYS})


def test_small_pool_evicts_and_stays_exact(one_layer: Path, log: Path) -> None:
    # A pool that cannot hold the whole workload evicts index entries between requests; what is
    # still served from cache stays exact.
    def cached(report: dict) -> int:
        return report["served"]["pic"]["pic_tokens"] + report["served"]["pic"]["prefix_tokens"]

    roomy, tight = _run(one_layer, log), _run(one_layer, log, num_slots=900)
    assert tight["num_slots"] == 900 and roomy["num_slots"] > 900
    assert cached(tight) < cached(roomy)
    assert tight["kl_pic_all"] <= 1e-9 and tight["first_divergence_pic_all"] == N


def test_cli_end_to_end(one_layer: Path, log: Path, tmp_path: Path,
                        capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "report.json"
    assert main(["-q", "consistency", "--model", str(one_layer), "--workload", str(log),
                 "--json", str(out), "--tokens", "4", "--requests", "5"]) == 0
    report = json.loads(out.read_text())
    assert set(KEYS) <= report.keys()
    assert report["requests"] == 5 and report["tokens"] == 4
    assert report["requests_with_hits"] >= 1 and report["first_divergence_pic"] == 4
    assert "Output consistency" in capsys.readouterr().out


def test_tokenizer_override(one_layer: Path, log: Path, tmp_path: Path) -> None:
    bare = build(tmp_path / "bare", layers=1, tokenizer=False)
    out = tmp_path / "report.json"
    assert main(["-q", "consistency", "--model", str(bare), "--workload", str(log),
                 "--tokenizer", str(one_layer), "--tokens", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["requests"] == len(workload())


def test_model_without_tokenizer_is_a_clear_error(tmp_path: Path, log: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    bare = build(tmp_path, layers=1, tokenizer=False)
    assert main(["-q", "consistency", "--model", str(bare), "--workload", str(log)]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json" in err and "--tokenizer" in err


def test_tokenizer_without_chat_template_is_a_clear_error(one_layer: Path, tmp_path: Path,
                                                          log: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes((one_layer / "tokenizer.json").read_bytes())
    assert main(["-q", "consistency", "--model", str(one_layer), "--workload", str(log),
                 "--tokenizer", str(tok)]) == 2
    assert "chat_template" in capsys.readouterr().err


def test_tokenizer_larger_than_the_model_is_a_clear_error(tmp_path: Path, log: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    small = build(tmp_path, layers=1, vocab_size=64)  # the tokenizer's ids reach 399
    assert main(["-q", "consistency", "--model", str(small), "--workload", str(log)]) == 2
    assert "vocab_size 64" in capsys.readouterr().err


def test_too_few_slots_is_a_clear_error(one_layer: Path, log: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    assert main(["-q", "consistency", "--model", str(one_layer), "--workload", str(log),
                 "--slots", "100"]) == 2
    assert "--slots" in capsys.readouterr().err
