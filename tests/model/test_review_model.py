"""Review: checkpoints and configs that would be served wrongly must be refused at load.

Each checkpoint is a tiny transformers model (the reference) written with ``save_pretrained``,
then edited by hand; the expectation is the refusal the loader promises (an error naming the
tensor or config key), never a silent load."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

# tests/model is on sys.path under pytest (rootdir-relative imports of test modules)
from test_model_loader import CASES, build_hf, config_of, read_all, save, write_checkpoint  # noqa: E402

from irminsul.model import CheckpointError, load_model  # noqa: E402
from irminsul.model.config import ConfigError, parse_config  # noqa: E402
from irminsul.parallel.load import load_shard  # noqa: E402


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    directory = save(build_hf(CASES["v2"], seed=1), tmp_path_factory.mktemp("v2"))
    return read_all(directory), config_of(directory)


@pytest.mark.parametrize("victim,dim", [("model.layers.0.mlp.gate_proj.weight", 0),
                                        ("model.layers.1.self_attn.kv_b_proj.weight", 0),
                                        ("model.layers.1.self_attn.o_proj.weight", 1)])
@pytest.mark.parametrize("rank", [0, 1])
def test_load_shard_refuses_a_misshapen_tensor(v2, tmp_path, victim: str, dim: int,
                                               rank: int) -> None:
    """A tensor with more rows (columns) than config.json implies: load_model refuses it, and so
    must every rank's load_shard — not keep its slice of the wrong tensor and drop the rest."""
    tensors, config = v2
    tensors = dict(tensors)
    w = tensors[victim]
    pad = list(w.shape)
    pad[dim] = 32
    tensors[victim] = torch.cat([w, torch.zeros(pad)], dim)
    path = write_checkpoint(tmp_path / "misshapen", tensors, config)
    with pytest.raises(CheckpointError, match=victim):
        load_model(path)
    with pytest.raises(CheckpointError, match=victim):
        load_shard(path, rank, 2)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool, torch.uint8])
def test_non_float_tensor_is_refused(v2, tmp_path, dtype: torch.dtype) -> None:
    """A weight stored as integers or booleans (a quantized or corrupt checkpoint) is not cast to
    float silently: refused, naming the tensor and its dtype."""
    tensors, config = v2
    tensors = dict(tensors)
    victim = "model.layers.1.self_attn.kv_b_proj.weight"
    tensors[victim] = torch.ones_like(tensors[victim], dtype=dtype)
    path = write_checkpoint(tmp_path / "ints", tensors, config)
    with pytest.raises(CheckpointError, match=victim):
        load_model(path)
    with pytest.raises(CheckpointError, match=victim):
        load_shard(path, 0, 2)


@pytest.mark.parametrize("act", ["gelu", "relu", "gelu_pytorch_tanh"])
def test_unsupported_hidden_act_is_refused(v2, act: str) -> None:
    """transformers' DeepseekV2/V3 MLPs use ACT2FN[hidden_act]; the runtime's are SiLU only, so
    another activation must be refused, naming the key."""
    _, config = v2
    assert parse_config(config).model_type == "deepseek_v2"  # silu: accepted
    assert parse_config({k: v for k, v in config.items() if k != "hidden_act"})
    with pytest.raises(ConfigError, match="hidden_act"):
        parse_config(dict(config, hidden_act=act))


def test_unsupported_hidden_act_refused_at_load(v2, tmp_path) -> None:
    tensors, config = v2
    path = write_checkpoint(tmp_path / "gelu", tensors, dict(config, hidden_act="gelu"))
    with pytest.raises(ConfigError, match="hidden_act"):
        load_model(path)


def test_serve_refuses_a_tokenizer_larger_than_the_vocabulary(v2, tmp_path) -> None:
    """A checkpoint whose tokenizer.json has ids past config.json's vocab_size (the tokenizer of
    another model copied in): every prompt holding such an id would index past the embedding
    (a 500 per request on a CPU, a device-side assert on CUDA). The server must refuse to start,
    naming vocab_size, as it does for --random-weights."""
    import shutil

    from irminsul.config import EngineConfig, ServerConfig
    from irminsul.model import default_model_dir
    from irminsul.server.launch import build_server
    from irminsul.traffic.render import ChatRenderer

    tensors, config = v2
    path = write_checkpoint(tmp_path / "tiny", tensors, config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, path / name)
    ids = ChatRenderer.from_dir(path).tokenizer.get_vocab_size(True)
    assert ids > config["vocab_size"]  # 8,192 ids against 97 rows of embedding
    with pytest.raises(ValueError, match="vocab_size"):
        build_server(path, ServerConfig(gate=None, warmup=False, device="cpu",
                                        engine=EngineConfig(mode="off")))


@pytest.mark.parametrize("extra", [{"attention_factor": 1.25}, {"truncate": False},
                                   {"attention_factor": 0.9, "mscale": 0.707,
                                    "mscale_all_dim": 0.707}])
def test_yarn_fields_match_transformers_or_are_refused(extra: dict) -> None:
    """transformers' YaRN (the reference for rope_parameters) honours ``attention_factor`` (the
    cos/sin magnitude, instead of the one derived from mscale) and ``truncate: false`` (an
    unrounded correction range). The runtime must compute the same frequencies and magnitude, or
    refuse the config naming the field — not serve plain-YaRN numbers."""
    import numpy as np
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from irminsul.model.rope import cos_sin_magnitude, inv_freq

    base = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=16, v_head_dim=16, intermediate_size=96, q_lora_rank=None,
                max_position_embeddings=5120)
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
              "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1, **extra}
    reference = transformers.DeepseekV3Config(**base, rope_parameters=params)
    want_freq, want_magnitude = ROPE_INIT_FUNCTIONS["yarn"](reference, "cpu")
    try:
        ours = parse_config(reference.to_dict())
    except ConfigError as err:
        assert any(key in str(err) for key in extra)
        return
    got = inv_freq(ours.rope, ours.qk_rope_head_dim)
    np.testing.assert_allclose(got, want_freq.double().numpy(), rtol=1e-6)
    assert cos_sin_magnitude(ours.rope) == pytest.approx(want_magnitude, rel=1e-9)


@pytest.mark.parametrize("scoring", ["sigmoid", "tanh"])
def test_v2_scoring_func_other_than_softmax_is_refused(scoring: str) -> None:
    """A deepseek_v2 router is softmax only (the checkpoints' own MoEGate raises
    NotImplementedError for anything else); a config asking for another scoring function must be
    refused naming the key, not routed by softmax. The shipped V2-Lite config still parses."""
    from pathlib import Path

    reference = Path("/work/shared/reference/configs/DeepSeek-V2-Lite.config.json")
    raw = (json_load(reference) if reference.is_file() else
           dict(model_type="deepseek_v2", vocab_size=97, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=16, v_head_dim=16, intermediate_size=96,
                max_position_embeddings=4096, rope_theta=10000.0, n_routed_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=24, scoring_func="softmax"))
    assert parse_config(raw).scoring_func == "softmax"
    with pytest.raises(ConfigError, match="scoring_func"):
        parse_config(dict(raw, scoring_func=scoring))


def json_load(path):
    import json

    return json.loads(path.read_text("utf-8"))


@pytest.mark.parametrize("edit,key", [({"moe_layer_freq": 0}, "moe_layer_freq"),
                                      ({"first_k_dense_replace": None}, "first_k_dense_replace"),
                                      ({"rms_norm_eps": None}, "rms_norm_eps"),
                                      ({"topk_group": 3}, "topk_group"),
                                      ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
                                      ({"num_experts_per_tok": 0}, "num_experts_per_tok")])
def test_malformed_moe_fields_are_config_errors(v2, edit: dict, key: str) -> None:
    """Malformed routing fields give a ConfigError naming the key at parse time — not a
    ZeroDivisionError / TypeError from deep inside (a bare traceback from the CLI), nor a
    'selected index k out of range' from torch's topk at the first request."""
    _, config = v2  # 8 routed experts, 2 per token; group-limited over 2 groups below
    raw = {**config, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1,
           **edit}
    with pytest.raises(ConfigError, match=key):
        parse_config(raw)
