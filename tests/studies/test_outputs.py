"""``irminsul study roc|sink|consistency`` on a tiny chat model: each writes a valid PNG and a
JSON report with its documented keys. The consistency study runs one workload pattern here
(through :func:`run_study`, what the command calls): its prompts are real agent requests of
thousands of tokens, and five patterns would take minutes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures.tiny_chat_model import random_model, write_tokenizer

from irminsul.cli import main
from irminsul.model import load_model
from irminsul.studies.reuse import prefill
from irminsul.studies.run import run_study
from irminsul.studies.sink import HEADER_RANGE, SinkSettings, carve_out
from irminsul.studies.text import AgentText
from irminsul.traffic.render import ChatRenderer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
KEYS = {
    "roc": {"study", "model", "settings", "pairs", "components", "auc_per_layer", "auc_mean",
            "paper", "seconds"},
    "sink": {"study", "model", "settings", "anchoring", "carve_out", "paper", "seconds"},
    "consistency": {"study", "model", "settings", "workloads", "seconds"},
}
OPTIONS = {"roc": ["--blocks", "3"], "sink": ["--samples", "1", "--reuse-samples", "2",
                                              "--repair-share", "0.2", "--repair-check-layer", "1"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer random model with a tokenizer and chat template, its context long enough for
    the samples' prompts in its small vocabulary."""
    directory = tmp_path_factory.mktemp("tiny_chat")
    size = write_tokenizer(directory)
    random_model(size, layers=2, max_position_embeddings=1 << 16).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("study", ["roc", "sink", "consistency"])
def test_study_writes_png_and_json(study: str, model_dir: Path, tmp_path: Path,
                                   capsys: pytest.CaptureFixture) -> None:
    if study == "consistency":
        text, _ = run_study(study, model_dir, tmp_path, options={
            "requests": 3, "tokens": 2, "patterns": ("agent_meta",)})
        print(text)
    else:
        assert main(["-q", "study", study, "--model", str(model_dir), "--out", str(tmp_path),
                     *OPTIONS[study]]) == 0
    png = (tmp_path / f"{study}.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000
    report = json.loads((tmp_path / f"{study}.json").read_text("utf-8"))
    assert KEYS[study] <= report.keys()
    assert report["study"] == study and report["model"] == model_dir.name
    printed = capsys.readouterr().out
    assert ("c_KV" if study == "roc" else "W uniform" if study == "sink" else "agent_meta") in printed
    if study == "roc":
        assert set(report["auc_mean"]) == {"c_KV", "k_r", "row", "k_r_rotated"}
        assert all(len(v) == 2 for v in report["auc_per_layer"].values())
        assert all(0.0 <= v <= 1.0 for v in report["auc_mean"].values())
        assert report["pairs"]["positive"] == 3 * 10 * 32
    elif study == "sink":
        anchoring, carve = report["anchoring"], report["carve_out"]
        assert len(anchoring["W"]) == len(anchoring["positions"]) == 10
        # At p = 0 the chunk starts the prompt: W and S coincide by construction.
        assert anchoring["W"][0] == pytest.approx(anchoring["S"][0], abs=1e-4)
        assert set(carve["deviation"]) == {"pic", "naive", "pic_no_carve_out", "pic_head",
                                           "pic_blend", "pic_recent"}
        assert (report["settings"]["repair_share"],
                report["settings"]["repair_check_layer"]) == (0.2, 1)
        # Layer 0's rows are position-and-token only: PIC is exact there.
        assert carve["deviation_per_layer"]["pic"][0] < 1e-5
    else:
        workload = report["workloads"]["agent_meta"]
        assert workload["requests"] == 3 and "per_request" not in workload
        assert {"kl_pic", "kl_naive", "argmax_pic", "argmax_naive"} <= workload.keys()


@pytest.mark.parametrize(("path", "repair", "whole"), [
    ("pic_head", {"repair_head": 0}, False), ("pic_head", {"repair_head": 256}, True),
    ("pic_blend", {"repair_share": 0.0}, False), ("pic_blend", {"repair_share": 1.0}, True),
    ("pic_recent", {"repair_share": 0.0}, False), ("pic_recent", {"repair_share": 1.0}, True)])
def test_sink_repair_paths_span_pic_to_fresh(model_dir: Path, path: str, repair: dict,
                                             whole: bool) -> None:
    """The carve-out's repair paths compute some of the body's tokens in place (EPIC: its first
    ``repair_head``; CacheBlend: the ``repair_share`` deviating most; recent: that share's
    last tokens): none is the plain PIC
    path, the whole body the fresh path (up to float summation order) — the two references
    they must lie between."""
    model = load_model(model_dir)
    text = AgentText.from_logs(ChatRenderer.from_dir(model_dir), contexts=2)
    settings = SinkSettings(reuse_samples=2, **repair)
    contexts = [prefill(model, text.context(i, HEADER_RANGE[1]), 0) for i in range(2)]
    carve = carve_out(model, text, settings, contexts, np.random.default_rng(0))
    reference = carve.fresh if whole else carve.paths["pic"]
    assert np.abs(carve.paths[path] - reference).max() <= (1e-5 if whole else 0)
    assert carve.deviation("pic") > 1e-4  # the two references differ: the test can tell them apart


def test_blended_rows_compute_each_picked_run_after_the_rows_before_it(model_dir: Path) -> None:
    """Picked tokens in two runs: each run's rows are what a prefill of that run after the
    header, the served rows and the runs before it gives (by hand, run by run); unpicked rows
    are the served ones, untouched."""
    from irminsul.studies.reuse import joined
    from irminsul.studies.sink import blended

    model = load_model(model_dir)
    rng = np.random.default_rng(5)
    header_tokens, body = rng.integers(0, 200, 40), rng.integers(0, 200, 20)
    header = prefill(model, header_tokens, 0)
    served = prefill(model, body, 7)  # computed elsewhere: stands for cached rows
    got = blended(model, body, 40, header, served, np.array([11, 3, 4]))
    picked = np.zeros(20, dtype=bool)
    picked[[3, 4, 11]] = True
    want = joined(header, [r[:3] for r in served])
    want = joined(want, prefill(model, body[3:5], 43, want))
    want = joined(want, [r[5:11] for r in served])
    want = joined(want, prefill(model, body[11:12], 51, want))
    want = joined(want, [r[12:] for r in served])
    for g, w, s in zip(got, want, served):
        assert torch.equal(g, w)
        assert torch.equal(g[40:][~torch.from_numpy(picked)], s[~torch.from_numpy(picked)])


@pytest.mark.parametrize(("repair", "message"), [
    ({"repair_check_layer": 2}, "repair_check_layer must be in [1, 1] for a model of 2 layers, got 2"),
    ({"repair_check_layer": 0}, "repair_check_layer must be in [1, 1] for a model of 2 layers, got 0"),
    ({"repair_share": 1.5}, "repair_share must be in [0, 1], got 1.5")])
def test_sink_refuses_repair_settings_the_model_cannot_take(model_dir: Path, repair: dict,
                                                           message: str) -> None:
    """A check layer the model lacks (or layer 0, exact by construction) or a share outside
    [0, 1] is refused before any work, naming the setting."""
    model = load_model(model_dir)
    text = AgentText.from_logs(ChatRenderer.from_dir(model_dir), contexts=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        carve_out(model, text, SinkSettings(reuse_samples=1, **repair), [],
                  np.random.default_rng(0))
