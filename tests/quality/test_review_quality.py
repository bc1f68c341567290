"""Review regressions: the gate's result cache and the consistency report's reuse subset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from irminsul.quality import result_cache


def _parts(**extra: object) -> dict:
    return {"checkpoint": "ab" * 32, "irminsul": "0", "probes": "cd" * 32, "tokens": 8,
            "device": "cpu", "dtype": "torch.float32", "kernels": False, "shard": None, **extra}


def test_a_tensor_parallel_key_is_found_again(tmp_path: Path) -> None:
    """Under tensor parallel the key holds the model's shard, a tuple (rank, ranks): what was
    saved under it must be read back, not measured again at every start."""
    parts = _parts(shard=(0, 2))
    measurement = [{"name": "p", "kl_pic": 0.001}]
    result_cache.save(tmp_path, parts, measurement)
    assert result_cache.load(tmp_path, parts) == measurement
    # and a different shard is still a different key
    assert result_cache.load(tmp_path, _parts(shard=(1, 2))) is None


@pytest.mark.parametrize("text", ["[]", "null", "3", '"x"', '{"key": 1, "measurement": []}'])
def test_a_cache_file_of_another_shape_counts_as_absent(tmp_path: Path, text: str) -> None:
    """A cache file that parses as JSON but is not the dict save() writes (a hand edit, another
    tool's file) is absent: the gate measures again rather than failing (which a server takes
    as a refusal of live PIC at every start)."""
    parts = _parts()
    path = result_cache.save(tmp_path, parts, [])
    path.write_text(text, "utf-8")
    assert result_cache.load(tmp_path, parts) is None
    json.loads(text)  # it is valid JSON: only its shape is wrong


def test_consistency_counts_a_derived_prefix_as_reuse(tmp_path: Path) -> None:
    """A follow-up whose prefix is an earlier turn's PIC-served rows (a derived prefix, no new
    registry hit) was served reused content: `irminsul consistency`'s figures over the requests
    that reused content include it, as the gate's do; only a request served nothing reused is
    left out."""
    from fixtures.tiny_chat_model import build, sentences, workload

    from irminsul.analysis.consistency import consistency
    from irminsul.model import load_model
    from irminsul.traffic.logs import Request
    from irminsul.traffic.render import ChatRenderer

    directory = build(tmp_path / "model", layers=2)
    first, moved = workload()[0], workload()[2]  # moved: first's documents behind sys_b
    follow_up = dict(moved, call=1, messages=moved["messages"] + [
        {"role": "assistant", "content": sentences(1, seed=21)[0]},
        {"role": "user", "content": sentences(1, seed=22)[0]}])
    requests = [Request(r["session"], r["call"], r["messages"], None, f"r{i}")
                for i, r in enumerate([first, moved, follow_up])]
    report = consistency(load_model(directory), ChatRenderer.from_dir(directory), requests,
                         tokens=4)
    rows = report["per_request"]
    # What the case needs: moved got registry hits, its follow-up only a derived prefix.
    assert rows[1]["pic"]["pic_tokens"] > 0
    assert rows[2]["pic"]["pic_tokens"] == 0 and rows[2]["pic"]["derived_prefix_tokens"] > 0
    assert rows[0]["pic"]["kl"] < 1e-12 < 1e-6 < rows[2]["pic"]["kl"]  # not float noise
    assert report["requests_with_hits"] == 2
    for path in ("pic", "naive"):
        want = (rows[1][path]["kl"] + rows[2][path]["kl"]) / 2
        assert report[f"kl_{path}"] == pytest.approx(want, rel=1e-12)


def test_hijack_study_runs_on_a_one_layer_model(tmp_path: Path) -> None:
    """`irminsul study hijack --model DIR` on a one-layer checkpoint: CacheBlend-style repair
    has no layer to check there (its check layer is 1), so its conditions are left out rather
    than the study failing. With one layer a reused row depends on its token and position only,
    so the victim served the attacker's rows gets the clean prompt's output (KL ~ 0)."""
    from fixtures.tiny_chat_model import random_model, write_tokenizer

    from irminsul.model import load_model
    from irminsul.studies.hijack import HijackSettings, hijack_study
    from irminsul.traffic.render import ChatRenderer

    directory = tmp_path / "model"
    size = write_tokenizer(directory)
    random_model(size, layers=1, max_position_embeddings=1 << 16).save_pretrained(directory)
    settings = HijackSettings(documents=1, tokens=2, min_doc_tokens=16, max_doc_tokens=4000)
    result = hijack_study(load_model(directory), ChatRenderer.from_dir(directory), settings)
    assert set(result.conditions) == {"benign", "hijack", "salted", "epic_k16", "epic_k32"}
    assert result.conditions["hijack"]["pic_tokens"] > 0
    assert result.conditions["hijack"]["kl_clean"] < 1e-9
