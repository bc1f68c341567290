"""`irminsul serve --random-weights CONFIG_JSON` (benchmark-only): a config's shapes with random
weights, served with the embedded model's tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures.fp8_config import FP8_QUANT

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


def test_random_fp8_shares_hold_each_ranks_part_in_float8(tmp_path: Path) -> None:
    """``--keep-fp8`` with ``--tensor-parallel``: each rank makes only its share, float8 where an
    FP8 checkpoint is (linears but the LM head and kv_b_proj; the routed experts), with the
    shapes sharding a whole model gives; the replicated weights are equal on every rank (each
    parameter drawn from its name's seed); the share's forward runs."""
    from irminsul.model.fp8 import FP8Linear
    from irminsul.parallel.shard import shard_weights

    path = config(tmp_path, quantization_config=FP8_QUANT)
    shares = [random_model(path, vocab=VOCAB, device="cpu", dtype=torch.float32,
                           keep_fp8=True, share=(rank, 2)) for rank in range(2)]
    whole = shard_weights(random_model(path, vocab=VOCAB, device="cpu", dtype=torch.float32,
                                       keep_fp8=True), 0, 2)
    want = {n: (tuple(p.shape), p.dtype) for n, p in whole.state_dict().items()}
    for share in shares:
        assert {n: (tuple(p.shape), p.dtype) for n, p in share.state_dict().items()} == want
    zero, one = (dict(s.named_parameters()) for s in shares)
    float8 = {n for n, p in zero.items() if p.dtype == torch.float8_e4m3fn}
    assert any(n.endswith("mlp.w13") for n in float8) and any("o_proj" in n for n in float8)
    assert not any("kv_b_proj" in n or n.startswith("lm_head") for n in float8)
    assert all(zero[n].float().std() > 0.5 for n in float8)  # ~N(0, 1), scaled by 0.02
    assert isinstance(shares[0].model.layers[0].self_attn.o_proj, FP8Linear)
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"):
        assert torch.equal(zero[name].float(), one[name].float()), name  # replicated: equal
    assert shares[1].model.layers[1].mlp.expert_first == 4
    assert torch.isfinite(shares[0].logits(torch.arange(12) * 300)).all()
