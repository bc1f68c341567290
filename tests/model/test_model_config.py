"""Tests for irminsul.model.config (config.json parsing) and the model/rotary it implies.

Everything here is checked against numbers written down independently of our code: the two real
config.json files are embedded verbatim below (DeepSeek-V2-Lite and DeepSeek-V3 as shipped on the
Hugging Face hub), tensor names/shapes come from the checkpoint layout spec (mla-models.md §2) and
are written out by hand, and rotary constants come from the spec (§4, §7) or from transformers'
own ``ROPE_INIT_FUNCTIONS``. Nothing reads files outside a tmp dir and nothing downloads; the real
models are instantiated on the ``meta`` device only (no memory).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from irminsul.model import ConfigError, MLAModel, load_config, parse_config
from irminsul.model.config import QuantConfig, RopeConfig
from irminsul.model.rope import Rotary, cos_sin_magnitude, inv_freq, softmax_scale

# ---------------------------------------------------------------------------------------------
# The real config.json files, verbatim (JSON null/true/false -> None/True/False).
# ---------------------------------------------------------------------------------------------

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 102400,
}

V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

REAL = {"v2_lite": V2_LITE, "v3": V3}


def variant(base: dict, **changes) -> dict:
    """A deep copy of ``base`` with top-level keys replaced (value ``...`` deletes the key)."""
    raw = copy.deepcopy(base)
    for key, value in changes.items():
        if value is ...:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def to_rope_parameters(raw: dict) -> dict:
    """Rewrite a legacy config (rope_theta + rope_scaling{"type"}) the way transformers 5 saves it
    (rope_parameters{"rope_type", "rope_theta", ...}); written by hand, not via our parser."""
    raw = copy.deepcopy(raw)
    theta = raw.pop("rope_theta")
    scaling = raw.pop("rope_scaling")
    if scaling is None:
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        params = {k: v for k, v in scaling.items() if k != "type"}
        raw["rope_parameters"] = {"rope_type": scaling["type"], "rope_theta": theta, **params}
    return raw


# ---------------------------------------------------------------------------------------------
# Parsing the real configs
# ---------------------------------------------------------------------------------------------


def test_v2_lite_config_parses_to_the_published_numbers():
    """DeepSeek-V2-Lite's config.json parses; every field the runtime uses has the spec's value."""
    c = parse_config(V2_LITE)
    assert c.model_type == "deepseek_v2"
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (
        102400, 2048, 27, 16)
    assert c.q_lora_rank is None
    assert (c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        512, 128, 64, 128)
    assert c.qk_head_dim == 192 and c.latent_dim == 576
    assert (c.intermediate_size, c.moe_intermediate_size) == (10944, 1408)
    assert (c.n_routed_experts, c.n_shared_experts, c.num_experts_per_tok) == (64, 2, 6)
    assert (c.first_k_dense_replace, c.moe_layer_freq, c.n_group, c.topk_group) == (1, 1, 1, 1)
    assert (c.topk_method, c.scoring_func, c.norm_topk_prob) == ("greedy", "softmax", False)
    assert c.routed_scaling_factor == 1.0
    assert c.rms_norm_eps == 1e-6 and c.max_position_embeddings == 163840
    assert c.rope_interleave is True  # key absent => interleaved (spec §1)
    assert c.attention_bias is False and c.tie_word_embeddings is False
    assert c.num_nextn_predict_layers == 0 and c.quantization is None
    assert c.rope == RopeConfig(theta=10000.0, kind="yarn", factor=40.0,
                                original_max_position=4096, beta_fast=32.0, beta_slow=1.0,
                                mscale=0.707, mscale_all_dim=0.707)
    assert not c.is_moe_layer(0)
    assert all(c.is_moe_layer(i) for i in range(1, 27))


def test_v3_config_parses_to_the_published_numbers():
    """DeepSeek-V3's config.json parses, including FP8 quantization and the MTP layer count."""
    c = parse_config(V3)
    assert c.model_type == "deepseek_v3"
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (
        129280, 7168, 61, 128)
    assert c.q_lora_rank == 1536
    assert (c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        512, 128, 64, 128)
    assert (c.intermediate_size, c.moe_intermediate_size) == (18432, 2048)
    assert (c.n_routed_experts, c.n_shared_experts, c.num_experts_per_tok) == (256, 1, 8)
    assert (c.first_k_dense_replace, c.n_group, c.topk_group) == (3, 8, 4)
    assert (c.topk_method, c.scoring_func, c.norm_topk_prob) == ("noaux_tc", "sigmoid", True)
    assert c.routed_scaling_factor == 2.5
    assert c.num_nextn_predict_layers == 1
    assert c.quantization == QuantConfig(block=(128, 128))
    assert c.rope_interleave is True
    assert c.rope == RopeConfig(theta=10000.0, kind="yarn", factor=40.0,
                                original_max_position=4096, beta_fast=32.0, beta_slow=1.0,
                                mscale=1.0, mscale_all_dim=1.0)
    assert [c.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]


def test_kimi_k2_model_type_is_treated_as_deepseek_v3():
    """``model_type: kimi_k2`` (Kimi-K2's config) parses as deepseek_v3 with V3 (noaux_tc,
    sigmoid) routing, even if the file's routing keys say otherwise."""
    kimi = variant(V3, model_type="kimi_k2", n_group=1, topk_group=1, n_routed_experts=384,
                   num_attention_heads=64, num_key_value_heads=64, first_k_dense_replace=1,
                   rope_theta=50000, topk_method="greedy", scoring_func="softmax",
                   rope_scaling={"type": "yarn", "factor": 32.0, "beta_fast": 1.0,
                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                 "original_max_position_embeddings": 4096})
    c = parse_config(kimi)
    assert c.model_type == "deepseek_v3"
    assert (c.topk_method, c.scoring_func) == ("noaux_tc", "sigmoid")
    assert c.n_routed_experts == 384 and c.num_attention_heads == 64
    assert c.rope.theta == 50000.0 and c.rope.factor == 32.0 and c.rope.beta_fast == 1.0
    # Same numbers, model_type deepseek_v3: identical config.
    assert parse_config(variant(kimi, model_type="deepseek_v3")) == c


@pytest.mark.parametrize("name", sorted(REAL))
def test_legacy_and_transformers5_rope_forms_give_identical_config(name):
    """The legacy form (rope_theta + rope_scaling{"type"}) and the transformers-5 form
    (rope_parameters{"rope_type"}), hand-converted, give the same RopeConfig and MLAConfig."""
    legacy = parse_config(REAL[name])
    modern_raw = to_rope_parameters(REAL[name])
    assert "rope_scaling" not in modern_raw and "rope_theta" not in modern_raw
    modern = parse_config(modern_raw)
    assert modern.rope == legacy.rope
    assert modern == legacy


@pytest.mark.parametrize("name", sorted(REAL))
def test_config_rewritten_by_transformers_parses_the_same(name):
    """A config dict as transformers 5 writes it (DeepseekV{2,3}Config(**raw).to_dict():
    rope_parameters with both "type" and "rope_type", head_dim = qk_rope_head_dim, extra keys)
    gives the same MLAConfig as the original file."""
    transformers = pytest.importorskip("transformers")
    cls = transformers.DeepseekV2Config if name == "v2_lite" else transformers.DeepseekV3Config
    rewritten = json.loads(json.dumps(cls(**copy.deepcopy(REAL[name])).to_dict()))
    assert "rope_parameters" in rewritten
    assert rewritten.get("head_dim") == 64  # NOT the attention head size (spec §1 pitfall)
    assert parse_config(rewritten) == parse_config(REAL[name])


def test_plain_rope_in_both_forms():
    """Plain RoPE: rope_scaling null, rope_scaling {"type": "default"}, and rope_parameters
    {"rope_type": "default"} all give RopeConfig(theta) with kind "default"."""
    forms = [
        variant(V3, rope_theta=50000, rope_scaling=None),
        variant(V3, rope_theta=50000, rope_scaling=...),
        variant(V3, rope_theta=50000, rope_scaling={"type": "default"}),
        variant(V3, rope_theta=..., rope_scaling=...,
                rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
        # rope_parameters without its own theta falls back to the top-level rope_theta
        variant(V3, rope_theta=50000, rope_scaling=..., rope_parameters={"rope_type": "default"}),
    ]
    for raw in forms:
        assert parse_config(raw).rope == RopeConfig(theta=50000.0), raw


def test_yarn_defaults_for_missing_betas():
    """A yarn dict without beta_fast/beta_slow gets the YaRN defaults 32 / 1 (spec §4.2)."""
    scaling = {k: v for k, v in V3["rope_scaling"].items() if not k.startswith("beta")}
    rope = parse_config(variant(V3, rope_scaling=scaling)).rope
    assert (rope.beta_fast, rope.beta_slow) == (32.0, 1.0)
    assert rope == parse_config(V3).rope


def test_rope_interleave_false_is_honoured():
    """``rope_interleave: false`` in a V3 config gives a half-split rotary; absent or true gives
    the interleaved (GPT-J) layout. Checked on the actual rotation against the spec's formulas."""
    half = parse_config(variant(V3, rope_interleave=False, rope_scaling=None))
    inter = parse_config(variant(V3, rope_interleave=True, rope_scaling=None))
    assert half.rope_interleave is False and inter.rope_interleave is True
    assert parse_config(variant(V3, rope_scaling=None)).rope_interleave is True

    dim, pos = 64, 37
    x = torch.randn(1, dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    angle = pos * 10000.0 ** (-np.arange(0, dim, 2) / dim)
    cos, sin = np.cos(angle), np.sin(angle)
    xs = x[0].numpy()
    # interleaved: pairs (2i, 2i+1)
    want_inter = np.empty(dim)
    want_inter[0::2] = xs[0::2] * cos - xs[1::2] * sin
    want_inter[1::2] = xs[1::2] * cos + xs[0::2] * sin
    # half-split: pairs (i, i + dim/2)
    want_half = np.concatenate([xs[:32] * cos - xs[32:] * sin, xs[32:] * cos + xs[:32] * sin])
    got_half = Rotary(half).apply(x.float(), torch.tensor([pos]))[0].double().numpy()
    got_inter = Rotary(inter).apply(x.float(), torch.tensor([pos]))[0].double().numpy()
    np.testing.assert_allclose(got_half, want_half, atol=1e-5)
    np.testing.assert_allclose(got_inter, want_inter, atol=1e-5)
    assert not np.allclose(got_half, got_inter, atol=1e-3)


def test_q_lora_rank_null_vs_set():
    """q_lora_rank null => a direct q_proj; an integer => q_a_proj/q_a_layernorm/q_b_proj."""
    assert parse_config(V2_LITE).q_lora_rank is None
    assert parse_config(variant(V2_LITE, q_lora_rank=...)).q_lora_rank is None
    assert parse_config(variant(V2_LITE, q_lora_rank=1536)).q_lora_rank == 1536
    tiny = variant(V2_LITE, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, kv_lora_rank=32, qk_nope_head_dim=8,
                   qk_rope_head_dim=16, v_head_dim=8, intermediate_size=32, vocab_size=11,
                   n_routed_experts=None)
    with torch.device("meta"):
        direct = MLAModel(parse_config(tiny)).state_dict()
        lora = MLAModel(parse_config(variant(tiny, q_lora_rank=24))).state_dict()
    attn = "model.layers.0.self_attn."
    assert direct[attn + "q_proj.weight"].shape == (2 * 24, 64)
    assert not any(k.startswith(attn + "q_a") or k.startswith(attn + "q_b") for k in direct)
    assert lora[attn + "q_a_proj.weight"].shape == (24, 64)
    assert lora[attn + "q_a_layernorm.weight"].shape == (24,)
    assert lora[attn + "q_b_proj.weight"].shape == (2 * 24, 24)
    assert attn + "q_proj.weight" not in lora


# ---------------------------------------------------------------------------------------------
# Refusals: a ConfigError naming the field
# ---------------------------------------------------------------------------------------------

YARN_V2 = V2_LITE["rope_scaling"]

REFUSALS = {
    # unknown rope types, legacy and transformers-5 spelling
    "rope_llama3": (variant(V2_LITE, rope_scaling={"type": "llama3", "factor": 8.0,
                                                    "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192}),
                    ["rope", "llama3"]),
    "rope_dynamic": (variant(V2_LITE, rope_scaling={"type": "dynamic", "factor": 2.0}),
                     ["rope", "dynamic"]),
    "rope_linear": (variant(V2_LITE, rope_scaling={"rope_type": "linear", "factor": 2.0}),
                    ["rope", "linear"]),
    "rope_longrope_params": (variant(V2_LITE, rope_theta=..., rope_scaling=...,
                                     rope_parameters={"rope_type": "longrope",
                                                      "rope_theta": 10000.0, "factor": 4.0}),
                             ["rope", "longrope"]),
    "rope_llama3_params": (variant(V2_LITE, rope_theta=..., rope_scaling=...,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                                                    "factor": 8.0}),
                           ["rope", "llama3"]),
    # a yarn-looking dict without a type must not silently become plain RoPE
    "rope_untyped_yarn_keys": (variant(V2_LITE, rope_scaling={
        k: v for k, v in YARN_V2.items() if k != "type"}), ["rope"]),
    # yarn dicts missing their keys
    "yarn_no_factor": (variant(V2_LITE, rope_scaling={k: v for k, v in YARN_V2.items()
                                                      if k != "factor"}), ["factor"]),
    "yarn_no_original_max": (variant(V2_LITE, rope_scaling={
        k: v for k, v in YARN_V2.items() if k != "original_max_position_embeddings"}),
        ["original_max_position_embeddings"]),
    "yarn_factor_null": (variant(V2_LITE, rope_scaling=dict(YARN_V2, factor=None)), ["factor"]),
    "yarn_params_no_factor": (variant(V2_LITE, rope_theta=..., rope_scaling=...,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                       "original_max_position_embeddings": 4096}),
                              ["factor"]),
    # rope_scaling / rope_parameters of the wrong JSON type
    "rope_scaling_string": (variant(V2_LITE, rope_scaling="yarn"), ["rope_scaling"]),
    "rope_scaling_list": (variant(V2_LITE, rope_scaling=[40, 4096]), ["rope_scaling"]),
    "rope_parameters_string": (variant(V2_LITE, rope_parameters="yarn"), ["rope_parameters"]),
    "no_rope_theta": (variant(V2_LITE, rope_theta=...), ["rope_theta"]),
    "rope_theta_negative": (variant(V2_LITE, rope_theta=-1), ["rope_theta"]),
    # quantization other than fp8 e4m3 block scaling
    "quant_awq": (variant(V3, quantization_config={"quant_method": "awq", "bits": 4}),
                  ["quantization", "awq"]),
    "quant_gptq": (variant(V3, quantization_config={"quant_method": "gptq", "bits": 4}),
                   ["quantization", "gptq"]),
    "quant_compressed_tensors": (variant(V3, quantization_config={
        "quant_method": "compressed-tensors", "format": "pack-quantized"}),
        ["quantization", "compressed-tensors"]),
    "quant_fp8_e5m2": (variant(V3, quantization_config=dict(V3["quantization_config"],
                                                            fmt="e5m2")),
                       ["quantization", "e5m2"]),
    "quant_not_a_dict": (variant(V3, quantization_config="fp8"), ["quantization"]),
    "quant_bad_block": (variant(V3, quantization_config=dict(V3["quantization_config"],
                                                             weight_block_size=[128])),
                        ["weight_block_size"]),
    # model types
    "model_type_llama": (variant(V2_LITE, model_type="llama"), ["model_type", "llama"]),
    "model_type_kimi_k25": (variant(V3, model_type="kimi_k25"), ["model_type", "kimi_k25"]),
    "model_type_missing": (variant(V2_LITE, model_type=...), ["model_type"]),
    # MLA has as many KV heads as query heads
    "kv_heads": (variant(V2_LITE, num_key_value_heads=1), ["num_key_value_heads"]),
    "q_lora_rank_string": (variant(V3, q_lora_rank="1536"), ["q_lora_rank"]),
    "n_group_not_dividing": (variant(V3, n_group=7), ["n_group"]),
    "v2_unknown_topk_method": (variant(V2_LITE, topk_method="noaux_tc"), ["topk_method"]),
}

REQUIRED = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "intermediate_size", "max_position_embeddings",
            # required once n_routed_experts is set
            "num_experts_per_tok", "moe_intermediate_size"]


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_name_the_field(case):
    """Configs the runtime cannot honour raise ConfigError whose message names the field/value."""
    raw, needles = REFUSALS[case]
    with pytest.raises(ConfigError) as err:
        parse_config(raw, where="/ckpt/config.json")
    message = str(err.value)
    assert message.startswith("/ckpt/config.json"), message
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.mark.parametrize("name", REQUIRED)
def test_missing_required_field_is_named(name):
    """Removing a required field (or giving it the wrong type) is a ConfigError naming it."""
    for raw in (variant(V3, **{name: ...}), variant(V3, **{name: "12"}),
                variant(V3, **{name: True})):
        with pytest.raises(ConfigError, match=name):
            parse_config(raw)


def test_non_object_json_is_refused():
    """A JSON value that is not an object is a ConfigError."""
    for raw in ([1, 2], "deepseek_v3", None, 3):
        with pytest.raises(ConfigError, match="object"):
            parse_config(raw)


def test_load_config_reads_file_and_directory(tmp_path):
    """load_config accepts config.json or its directory and gives parse_config's result."""
    (tmp_path / "config.json").write_text(json.dumps(V3), "utf-8")
    assert load_config(tmp_path) == parse_config(V3)
    assert load_config(tmp_path / "config.json") == parse_config(V3)


def test_load_config_missing_file(tmp_path):
    """A missing config.json (file or directory without one) is a ConfigError naming the path."""
    with pytest.raises(ConfigError, match="no such file") as err:
        load_config(tmp_path)
    assert "config.json" in str(err.value)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope" / "config.json")


@pytest.mark.parametrize("content", [b"{not json", b"", b'{"model_type": "deepseek_v3",}',
                                     b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe",
                                     b"\xff\xfe{\x00}\x00"],
                         ids=["truncated", "empty", "trailing_comma", "binary_png", "utf16"])
def test_load_config_non_json_file(tmp_path, content):
    """A config.json that is not valid JSON (text or binary, e.g. a weights file picked by
    mistake) is a ConfigError naming the path, not a raw decoder exception."""
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value)
    assert "JSON" in str(err.value)


def test_frozen_config_values_are_plain():
    """MLAConfig is frozen and RopeConfig holds floats (so two equal configs compare equal)."""
    c = parse_config(V2_LITE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 1  # type: ignore[misc]
    assert all(isinstance(getattr(c.rope, f), float)
               for f in ("theta", "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"))


# ---------------------------------------------------------------------------------------------
# Real shapes, on the meta device
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_models():
    """{name: (config, state-dict shapes)} of the real models built on the meta device."""
    out = {}
    for name, raw in REAL.items():
        config = parse_config(raw)
        with torch.device("meta"):
            model = MLAModel(config)
        out[name] = (config, model, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    return out


def _mlp(prefix: str, inner: int, d: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.gate_proj.weight": (inner, d), f"{prefix}.up_proj.weight": (inner, d),
            f"{prefix}.down_proj.weight": (d, inner)}


# Hand-written from mla-models.md §2 (V2-Lite real tensor list) — not derived from our code.
V2_LITE_ATTN = {
    "input_layernorm.weight": (2048,),
    "post_attention_layernorm.weight": (2048,),
    "self_attn.q_proj.weight": (3072, 2048),           # 16 * (128 + 64)
    "self_attn.kv_a_proj_with_mqa.weight": (576, 2048),
    "self_attn.kv_a_layernorm.weight": (512,),
    "self_attn.kv_b_proj.weight": (4096, 512),         # 16 * (128 + 128)
    "self_attn.o_proj.weight": (2048, 2048),           # 16 * 128
}
V2_LITE_DENSE = {**V2_LITE_ATTN, **_mlp("mlp", 10944, 2048)}
V2_LITE_MOE = {**V2_LITE_ATTN, "mlp.gate.weight": (64, 2048),
               **_mlp("mlp.shared_experts", 2816, 2048),  # 2 shared * 1408
               **{k: v for e in range(64) for k, v in _mlp(f"mlp.experts.{e}", 1408, 2048).items()}}

V3_ATTN = {
    "input_layernorm.weight": (7168,),
    "post_attention_layernorm.weight": (7168,),
    "self_attn.q_a_proj.weight": (1536, 7168),
    "self_attn.q_a_layernorm.weight": (1536,),
    "self_attn.q_b_proj.weight": (24576, 1536),        # 128 * 192
    "self_attn.kv_a_proj_with_mqa.weight": (576, 7168),
    "self_attn.kv_a_layernorm.weight": (512,),
    "self_attn.kv_b_proj.weight": (32768, 512),        # 128 * 256
    "self_attn.o_proj.weight": (7168, 16384),          # 128 * 128
}
V3_DENSE = {**V3_ATTN, **_mlp("mlp", 18432, 7168)}
V3_MOE = {**V3_ATTN, "mlp.gate.weight": (256, 7168), "mlp.gate.e_score_correction_bias": (256,),
          **_mlp("mlp.shared_experts", 2048, 7168),
          **{k: v for e in range(256) for k, v in _mlp(f"mlp.experts.{e}", 2048, 7168).items()}}


def _layer(shapes: dict, i: int) -> dict:
    prefix = f"model.layers.{i}."
    return {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}


def test_v2_lite_tensor_names_and_shapes(real_models):
    """V2-Lite on meta: layer 0 dense, layers 1..26 MoE with 64 experts, exact names/shapes."""
    _, _, shapes = real_models["v2_lite"]
    assert _layer(shapes, 0) == V2_LITE_DENSE
    assert _layer(shapes, 1) == V2_LITE_MOE
    assert _layer(shapes, 26) == V2_LITE_MOE
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in shapes
    assert not any(k.startswith("model.layers.27.") for k in shapes)
    assert shapes["model.embed_tokens.weight"] == (102400, 2048)
    assert shapes["lm_head.weight"] == (102400, 2048)
    assert shapes["model.norm.weight"] == (2048,)


def test_v2_lite_tensor_and_parameter_count(real_models):
    """V2-Lite: 5291 tensors (as in the real checkpoint) and ~15.7B parameters (1%)."""
    _, model, shapes = real_models["v2_lite"]
    assert len(shapes) == 5291
    want = (1 * sum(math.prod(s) for s in V2_LITE_DENSE.values())
            + 26 * sum(math.prod(s) for s in V2_LITE_MOE.values()) + 2 * 102400 * 2048 + 2048)
    total = sum(p.numel() for p in model.parameters())
    assert total == want
    assert abs(total - 15.7e9) / 15.7e9 < 0.01


def test_v3_tensor_names_and_shapes(real_models):
    """V3 on meta: q-LoRA attention, layers 0-2 dense, 3..60 MoE with 256 experts and the
    noaux_tc correction bias, 61 layers (MTP layer 61 not part of the model), vocab 129280."""
    _, _, shapes = real_models["v3"]
    for i in (0, 1, 2):
        assert _layer(shapes, i) == V3_DENSE, i
    for i in (3, 4, 60):
        assert _layer(shapes, i) == V3_MOE, i
    assert not any(k.startswith("model.layers.61.") for k in shapes)
    assert shapes["model.embed_tokens.weight"] == (129280, 7168)
    assert shapes["lm_head.weight"] == (129280, 7168)
    assert shapes["model.norm.weight"] == (7168,)
    assert len(shapes) == 3 * len(V3_DENSE) + 58 * len(V3_MOE) + 3 == 45395


def test_v3_parameter_count(real_models):
    """V3 without the MTP layer: ~671B parameters (hand-summed from the spec table; 1% check)."""
    _, model, _ = real_models["v3"]
    want = (3 * sum(math.prod(s) for s in V3_DENSE.values())
            + 58 * sum(math.prod(s) for s in V3_MOE.values()) + 2 * 129280 * 7168 + 7168)
    total = sum(p.numel() for p in model.parameters())
    assert total == want
    assert abs(total - 671e9) / 671e9 < 0.01


# ---------------------------------------------------------------------------------------------
# Rotary constants
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,expected", [("v2_lite", 0.114721387), ("v3", 0.135233779)])
def test_softmax_scale_of_real_configs(name, expected, real_models):
    """Softmax scale = 192^-0.5 * (0.1*mscale_all_dim*ln 40 + 1)^2 (spec §7 table), to 1e-8;
    the attention modules of the built model use it."""
    config, model, _ = real_models[name]
    assert softmax_scale(config) == pytest.approx(expected, abs=1e-8)
    m_all = REAL[name]["rope_scaling"]["mscale_all_dim"]
    g = 0.1 * m_all * math.log(40) + 1
    assert softmax_scale(config) == pytest.approx(192 ** -0.5 * g ** 2, rel=1e-12)
    assert model.model.layers[0].self_attn.scale == pytest.approx(expected, abs=1e-8)


def test_softmax_scale_without_yarn_is_plain():
    """No rope scaling => (qk_nope + qk_rope)^-0.5 = 0.072168784 (Moonlight-like)."""
    assert softmax_scale(parse_config(variant(V3, rope_scaling=None, rope_theta=50000))) == \
        pytest.approx(0.072168784, abs=1e-8)


@pytest.mark.parametrize("name", sorted(REAL))
def test_cos_sin_magnitude_is_one_for_real_configs(name, real_models):
    """mscale == mscale_all_dim in both real configs => cos/sin magnitude exactly 1.0."""
    config, model, _ = real_models[name]
    assert cos_sin_magnitude(config.rope) == 1.0
    assert model.rotary.magnitude == 1.0


def test_cos_sin_magnitude_when_mscales_differ():
    """mscale 1.0 vs mscale_all_dim 0.707 => magnitude g(40, 1)/g(40, 0.707) (spec §4.3)."""
    rope = dataclasses.replace(parse_config(V2_LITE).rope, mscale=1.0)
    g = lambda m: 0.1 * m * math.log(40) + 1  # noqa: E731
    assert cos_sin_magnitude(rope) == pytest.approx(g(1.0) / g(0.707), rel=1e-12)


def test_v2_lite_yarn_inv_freq_hand_values():
    """V2-Lite YaRN inv_freq (dim 64, theta 1e4, factor 40, ramp low=10 high=23), hand-computed:
    i=0 -> 1.0; i=8 -> 10000^-0.25 = 0.1 (below the ramp: unchanged); i=16 -> 0.0055 exactly
    (ramp 6/13: 0.01 * (7/13 + 6/13/40)); i=31 -> 10000^(-62/64)/40 (fully interpolated)."""
    f = inv_freq(parse_config(V2_LITE).rope, 64)
    assert f.shape == (32,) and f.dtype == np.float64
    assert f[0] == pytest.approx(1.0, rel=1e-15)
    assert f[8] == pytest.approx(0.1, rel=1e-14)
    assert f[16] == pytest.approx(0.0055, rel=1e-14)
    assert f[31] == pytest.approx(10000 ** (-62 / 64) / 40, rel=1e-14)
    # ramp edges: i <= 10 unchanged, i >= 23 divided by 40
    for i in range(0, 11):
        assert f[i] == pytest.approx(10000 ** (-2 * i / 64), rel=1e-14), i
    for i in range(23, 32):
        assert f[i] == pytest.approx(10000 ** (-2 * i / 64) / 40, rel=1e-14), i


KIMI_ROPE = {"rope_theta": 50000, "rope_scaling": {
    "type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}
ROPE_CASES = {
    "v2_lite": ("DeepseekV2Config", V2_LITE),
    "v3": ("DeepseekV3Config", V3),
    "kimi_k2_like": ("DeepseekV3Config", variant(V3, **KIMI_ROPE)),
    "moonlight_like": ("DeepseekV3Config", variant(V3, rope_theta=50000, rope_scaling=None)),
    "v2_lite_transformers5_form": ("DeepseekV2Config", to_rope_parameters(V2_LITE)),
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_inv_freq_matches_transformers(case):
    """inv_freq of the 64-dim rope slice equals transformers' ROPE_INIT_FUNCTIONS (yarn) or the
    default-rope computation on a DeepseekV{2,3}Config built from the same dict (float32 ref,
    rel err <= 1e-6); the attention factor agrees with our cos/sin magnitude."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cls_name, raw = ROPE_CASES[case]
    hf_config = getattr(transformers, cls_name)(**copy.deepcopy(raw))
    rope_type = hf_config.rope_parameters["rope_type"]
    if rope_type == "default":
        theta = hf_config.rope_parameters["rope_theta"]
        ref = 1.0 / theta ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64)
        attention_factor = 1.0
    else:
        ref, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    ref = ref.double().numpy()
    config = parse_config(raw)
    ours = inv_freq(config.rope, config.qk_rope_head_dim)
    assert ours.shape == ref.shape == (32,)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=0)
    assert cos_sin_magnitude(config.rope) == pytest.approx(attention_factor, rel=1e-12)


@pytest.mark.parametrize("name", sorted(REAL))
def test_softmax_scale_matches_transformers_attention(name):
    """Our softmax scale equals transformers' DeepseekV{2,3}Attention.scaling (built on meta)."""
    transformers = pytest.importorskip("transformers")
    if name == "v2_lite":
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention as A
        hf_config = transformers.DeepseekV2Config(**copy.deepcopy(V2_LITE))
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention as A
        hf_config = transformers.DeepseekV3Config(**copy.deepcopy(V3))
    with torch.device("meta"):
        attention = A(hf_config, 0)
    assert softmax_scale(parse_config(REAL[name])) == pytest.approx(attention.scaling, rel=1e-12)
