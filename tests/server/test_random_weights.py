"""`irminsul serve --random-weights CONFIG_JSON` (benchmark-only): a config's shapes with random
weights, served with the embedded model's tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from irminsul.cli import main
from irminsul.config import ServerConfig
from irminsul.model import default_model_dir
from irminsul.server.launch import build_server, random_model

VOCAB = 8192  # the embedded model's tokenizer


def config(tmp_path: Path, name: str = "config.json", **changes: object) -> Path:
    raw = json.loads((default_model_dir() / "config.json").read_text())
    raw.update({"num_hidden_layers": 2, "vocab_size": VOCAB + 1000, **changes})
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


def test_random_weights_of_a_configs_shapes(tmp_path: Path) -> None:
    model = random_model(config(tmp_path), vocab=VOCAB, device="cpu", dtype=torch.float32,
                         never=[1, 2])
    params = dict(model.named_parameters())
    assert model.lm_head.weight.shape[0] == VOCAB + 1000
    assert model.lm_head.weight[VOCAB:].abs().sum() == 0  # never the greedy pick
    assert model.lm_head.weight[1:3].abs().sum() == 0  # nor are the stop tokens
    assert 0.015 < model.lm_head.weight[:VOCAB].std() < 0.025
    assert all((p == 1).all() for name, p in params.items() if name.endswith("norm.weight"))
    assert all(p.dtype == torch.float32 for name, p in params.items() if ".mlp.gate." in name)
    ids = torch.arange(40) * 200  # ids across the tokenizer's range
    assert int(model.logits(ids)[-1].argmax()) < VOCAB
    again = random_model(config(tmp_path), vocab=VOCAB, device="cpu", dtype=torch.float32,
                         never=[1, 2])
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)  # seeded


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path: Path) -> None:
    path = config(tmp_path, vocab_size=4096)
    with pytest.raises(ValueError, match="vocab_size 4096 is smaller than the tokenizer's 8192"):
        random_model(path, vocab=VOCAB, device="cpu", dtype=torch.float32)
    assert main(["serve", "--random-weights", str(path), "--device", "cpu"]) == 2


def test_served_under_a_name_of_its_own(tmp_path: Path) -> None:
    (tmp_path / "DeepSeek-X").mkdir()
    _, engine = build_server(default_model_dir(), ServerConfig(device="cpu"),
                             random_weights=config(tmp_path / "DeepSeek-X"))
    model = engine.scheduler.engine.model
    assert model.config.vocab_size == VOCAB + 1000
    assert model.lm_head.weight[[1, 2]].abs().sum() == 0  # the default model's stop tokens
    app, _ = build_server(default_model_dir(), ServerConfig(device="cpu"),
                          random_weights=config(tmp_path, "v2-lite.json"))
    assert app.state.server.model_name == "random-v2-lite"


def test_serve_takes_random_weights_or_a_model(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--model", "DIR", "--random-weights", "C.json"]) == 2
    assert "does not take --model" in capsys.readouterr().err
