"""Tests for irminsul.model.loader: Hugging Face checkpoint directories -> MLAModel.

The reference is transformers itself: tiny random ``DeepseekV2ForCausalLM`` /
``DeepseekV3ForCausalLM`` models (weights re-initialised with std 0.2 so the outputs are far from
trivial) are written with ``save_pretrained`` — single file, sharded, tied embeddings — and our
loaded model must reproduce their logits. FP8 block-quantized checkpoints, MTP layers and broken
checkpoints are written by hand with ``safetensors.torch.save_file``; the expected dequantized
weights come from a per-element formula written here (spec: W[m,n] = float(Wq[m,n]) *
scale_inv[m // block_rows, n // block_cols]). Nothing downloads; everything lives in tmp dirs.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from irminsul.model import CheckpointError, MLAModel, load_model  # noqa: E402

VOCAB = 97
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
            v_head_dim=16, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
            max_position_embeddings=5120, rms_norm_eps=1e-6, attn_implementation="eager")
# V2-Lite-like: no q-LoRA, YaRN with mscale == mscale_all_dim (softmax scale * g^2), greedy softmax
V2_CASE = ("DeepseekV2", dict(q_lora_rank=None, topk_method="greedy", norm_topk_prob=False,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                               "factor": 40.0,
                                               "original_max_position_embeddings": 128,
                                               "beta_fast": 32, "beta_slow": 1,
                                               "mscale": 0.707, "mscale_all_dim": 0.707}))
# V3-like: q-LoRA, sigmoid + correction bias, 2 groups, renormalised and scaled weights
V3_CASE = ("DeepseekV3", dict(q_lora_rank=24, n_group=2, topk_group=1, norm_topk_prob=True,
                              routed_scaling_factor=2.5,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
# FP8 tiny V3 whose dims are mostly NOT multiples of the 16x16 block: partial edge blocks.
FP8_BLOCK = 16
FP8_CASE = ("DeepseekV3", dict(hidden_size=72, kv_lora_rank=36, q_lora_rank=40,
                               qk_nope_head_dim=12, qk_rope_head_dim=16, v_head_dim=12,
                               intermediate_size=100, moe_intermediate_size=40, n_group=2,
                               topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
CASES = {"v2": V2_CASE, "v3": V3_CASE}

IDS = torch.tensor([5, 17, 3, 96, 0, 42, 42, 8, 61, 29, 77, 13, 50, 2])


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------



FUSED = re.compile(r"(model\.layers\.\d+\.mlp)\.(w13|w2)")


def unfused(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A loaded model's state dict in the checkpoint's names: the fused expert stacks w13[e] =
    [gate_proj; up_proj] and w2[e] = down_proj split back into mlp.experts.{e}.*_proj.weight."""
    out = {}
    for key, t in state.items():
        m = FUSED.fullmatch(key)
        if m is None:
            out[key] = t
            continue
        for e, w in enumerate(t):
            if m.group(2) == "w2":
                out[f"{m.group(1)}.experts.{e}.down_proj.weight"] = w
            else:
                half = w.shape[0] // 2
                out[f"{m.group(1)}.experts.{e}.gate_proj.weight"] = w[:half]
                out[f"{m.group(1)}.experts.{e}.up_proj.weight"] = w[half:]
    return out

def build_hf(case: tuple[str, dict], seed: int = 0, **overrides):
    """A tiny random transformers model (eval) for ``case``; 2-D weights ~ N(0, 0.2), 1-D norm
    weights ~ N(1, 0.2), V3 correction biases ~ N(0, 0.1)."""
    family, extra = case
    config = getattr(transformers, f"{family}Config")(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.2)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.1)
    return model


def hf_logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def save(model, directory: Path, **kwargs) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, **kwargs)
    return directory


def read_all(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved checkpoint (single file or shards)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def write_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """A single-file checkpoint written by hand."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config), "utf-8")
    return directory


def config_of(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text("utf-8"))


def assert_logits_equal(ours: torch.Tensor, ref: torch.Tensor, atol: float = 1e-4) -> None:
    assert ours.shape == ref.shape == (len(IDS), VOCAB)
    assert ref.abs().max() > 1.0, "reference logits are trivially small"
    diff = (ours - ref).abs().max().item()
    assert diff <= atol, f"max |ours - transformers| = {diff:.3g}"


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Which tensors an FP8 DeepSeek checkpoint stores in float8: 2-D linear weights except the
    router gate, the embeddings and lm_head (spec §2)."""
    return (tensor.dim() == 2 and name.endswith(".weight") and not name.endswith("mlp.gate.weight")
            and "embed_tokens" not in name and not name.startswith("lm_head"))


def quantize(w: torch.Tensor, br: int = FP8_BLOCK,
             bc: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(br x bc) block absmax FP8 e4m3 quantization: (q float8 [M,N], scale_inv fp32
    [ceil(M/br), ceil(N/bc)]) with w ~= q * scale_inv per block."""
    m, n = w.shape
    rows, cols = math.ceil(m / br), math.ceil(n / bc)
    scale = torch.empty(rows, cols, dtype=torch.float32)
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].float()
            s = blk.abs().max().clamp_min(1e-12) / 448.0
            scale[i, j] = s
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def naive_dequant(q: torch.Tensor, scale_inv: torch.Tensor, br: int = FP8_BLOCK,
                  bc: int = FP8_BLOCK) -> torch.Tensor:
    """w[m, n] = float(q[m, n]) * s[m // br, n // bc], element by element."""
    qs, ss = q.float().tolist(), scale_inv.float().tolist()
    return torch.tensor([[qs[m][n] * ss[m // br][n // bc] for n in range(len(qs[m]))]
                         for m in range(len(qs))], dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# fixtures: one transformers model + checkpoint per case, shared by the module
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{case: (hf_model, single-file dir, reference logits)}."""
    out = {}
    for name, case in CASES.items():
        model = build_hf(case, seed=1 if name == "v2" else 2)
        directory = save(model, tmp_path_factory.mktemp(f"{name}_single"))
        out[name] = (model, directory, hf_logits(model))
    return out


class FP8Checkpoint(NamedTuple):
    directory: Path  # the hand-written FP8 checkpoint (16x16 blocks)
    source: dict[str, torch.Tensor]  # the fp32 tensors it was quantized from
    expected: dict[str, torch.Tensor]  # per-element dequantization of every quantized tensor
    deq_dir: Path  # the expected weights as a plain fp32 checkpoint (for transformers)
    quantized: list[str]  # names stored as float8


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> FP8Checkpoint:
    """A hand-written FP8 checkpoint of a tiny V3 model (16x16 blocks, partial edge blocks)."""
    model = build_hf(FP8_CASE, seed=3)
    plain = save(model, tmp_path_factory.mktemp("fp8_src"))
    tensors = read_all(plain)
    config = config_of(plain)
    fp8_tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    quantized = []
    for name, t in tensors.items():
        if is_quantized(name, t):
            q, s = quantize(t)
            fp8_tensors[name], fp8_tensors[name + "_scale_inv"] = q, s
            expected[name] = naive_dequant(q, s)
            quantized.append(name)
        else:
            fp8_tensors[name] = t
            expected[name] = t
    fp8_dir = write_checkpoint(tmp_path_factory.mktemp("fp8"), fp8_tensors,
                               dict(config, quantization_config=FP8_QUANT))
    # the same (dequantized) weights as a plain fp32 checkpoint, for transformers to read
    deq_dir = write_checkpoint(tmp_path_factory.mktemp("fp8_deq"), expected, config)
    return FP8Checkpoint(fp8_dir, tensors, expected, deq_dir, sorted(quantized))


# ---------------------------------------------------------------------------------------------
# logits equal transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_single_file_checkpoint_matches_transformers(saved, name):
    """A save_pretrained single-file checkpoint loads; fp32 logits equal transformers' (1e-4)."""
    _, directory, ref = saved[name]
    assert (directory / "model.safetensors").is_file()
    assert not (directory / "model.safetensors.index.json").exists()
    model = load_model(directory)
    assert isinstance(model, MLAModel) and not model.training
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert_logits_equal(model.logits(IDS), ref)


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_checkpoint_matches_transformers(saved, tmp_path, name):
    """save_pretrained(max_shard_size="20KB") writes model.safetensors.index.json + many shards;
    it loads and gives the same logits as transformers (1e-4)."""
    hf, _, ref = saved[name]
    directory = save(hf, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert not (directory / "model.safetensors").exists()
    assert len(set(index["weight_map"].values())) > 3
    assert_logits_equal(load_model(directory).logits(IDS), ref)


@pytest.mark.parametrize("name", sorted(CASES))
def test_loaded_weights_equal_checkpoint_tensors(saved, name):
    """Every checkpoint tensor lands, bit for bit, in the parameter of the same name (routed
    experts in their fused stacks, read back per expert)."""
    _, directory, _ = saved[name]
    tensors = read_all(directory)
    state = unfused(load_model(directory).state_dict())
    assert set(state) == set(tensors)
    for key, t in tensors.items():
        assert torch.equal(state[key], t), key


def test_v3_correction_bias_is_loaded(saved):
    """The V3 router's e_score_correction_bias is loaded (not left at its zero init)."""
    _, directory, _ = saved["v3"]
    model = load_model(directory)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, read_all(directory)["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert bias.abs().max() > 0


# ---------------------------------------------------------------------------------------------
# FP8 block quantization
# ---------------------------------------------------------------------------------------------


def test_fp8_fixture_exercises_partial_blocks(fp8):
    """Sanity of the FP8 fixture: float8 weights with fp32 [ceil(M/16), ceil(N/16)] scales,
    several blocks per tensor, and tensors whose dims are not multiples of 16."""
    directory, quantized = fp8.directory, fp8.quantized
    tensors = load_file(str(directory / "model.safetensors"))
    assert len(quantized) > 20
    partial = 0
    for name in quantized:
        q, s = tensors[name], tensors[name + "_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert s.shape == (math.ceil(q.shape[0] / 16), math.ceil(q.shape[1] / 16))
        partial += q.shape[0] % 16 != 0 or q.shape[1] % 16 != 0
    assert partial >= 5
    assert tensors["model.layers.1.self_attn.q_a_proj.weight"].shape == (40, 72)  # 3x5 blocks
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32
    assert tensors["lm_head.weight"].dtype == torch.float32


def test_fp8_weights_equal_naive_dequantization(fp8):
    """FP8 checkpoint: every dequantized weight equals the per-element formula exactly, and the
    non-quantized tensors (norms, router, embeddings, lm_head) are loaded unchanged."""
    directory, expected = fp8.directory, fp8.expected
    state = unfused(load_model(directory).state_dict())
    assert set(state) == set(expected)
    for name, want in expected.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], want), name
    # the scales matter: blocks have different scales, so a wrong block index would show
    scales = load_file(str(directory / "model.safetensors"))[
        "model.layers.1.self_attn.q_a_proj.weight_scale_inv"]
    assert scales.unique().numel() == scales.numel()


def test_fp8_non_square_blocks(fp8, tmp_path):
    """weight_block_size [rows, cols] is read in that order: a checkpoint quantized with 8x32
    blocks dequantizes per element as q[m, n] * s[m // 8, n // 32] (a row/column swap shows)."""
    src, tensors, quantized = fp8.directory, fp8.source, fp8.quantized
    out, expected = {}, {}
    for name, t in tensors.items():
        if name in quantized:
            q, s = quantize(t, 8, 32)
            out[name], out[name + "_scale_inv"] = q, s
            expected[name] = naive_dequant(q, s, 8, 32)
        else:
            out[name] = expected[name] = t
    config = dict(config_of(src), quantization_config=dict(FP8_QUANT, weight_block_size=[8, 32]))
    state = unfused(load_model(write_checkpoint(tmp_path / "ckpt", out, config)).state_dict())
    for name, want in expected.items():
        assert torch.equal(state[name], want), name


def test_fp8_logits_match_transformers_on_dequantized_weights(fp8):
    """The FP8-loaded model gives the logits transformers gives on the same dequantized weights
    (read by transformers from a plain fp32 checkpoint), within 1e-4."""
    directory, deq_dir = fp8.directory, fp8.deq_dir
    ref_model = transformers.DeepseekV3ForCausalLM.from_pretrained(
        deq_dir, attn_implementation="eager").eval()
    assert_logits_equal(load_model(directory).logits(IDS), hf_logits(ref_model))


def test_fp8_scale_in_another_shard(fp8, tmp_path):
    """Sharded FP8 checkpoint whose weight_scale_inv tensors live in a different shard than their
    weights (the index maps each name to its file): loads, same weights as the single file."""
    directory, expected = fp8.directory, fp8.expected
    tensors = load_file(str(directory / "model.safetensors"))
    scales = {k: v for k, v in tensors.items() if k.endswith("_scale_inv")}
    weights = {k: v for k, v in tensors.items() if k not in scales}
    out = tmp_path / "split"
    out.mkdir()
    # scales first, so the reader meets the scale shard before (and apart from) the weights
    files = {"model-00001-of-00002.safetensors": scales,
             "model-00002-of-00002.safetensors": weights}
    for fname, part in files.items():
        save_file(part, str(out / fname), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, part in files.items() for k in part}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(directory / "config.json", out / "config.json")
    state = unfused(load_model(out).state_dict())
    for name, want in expected.items():
        assert torch.equal(state[name], want), name


def test_fp8_scale_of_wrong_shape_is_refused(fp8, tmp_path):
    """A scale_inv whose shape is not [ceil(M/b), ceil(N/b)] for the config's block size (e.g. a
    checkpoint quantized with 16x16 blocks but a config saying 128x128, or a truncated scale) is
    an error naming the tensor, never a silently wrong dequantization."""
    directory = fp8.directory
    tensors = load_file(str(directory / "model.safetensors"))
    config = config_of(directory)
    # 1) config block size disagrees with the scales (scales larger than 128x128 blocks imply)
    wrong_block = write_checkpoint(tmp_path / "block128", tensors, dict(
        config, quantization_config=dict(FP8_QUANT, weight_block_size=[128, 128])))
    with pytest.raises(CheckpointError, match=r"weight_scale_inv"):
        load_model(wrong_block)
    # 2) one scale truncated by a row
    name = "model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"
    bad = dict(tensors, **{name: tensors[name][:-1].clone()})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_model(write_checkpoint(tmp_path / "short", bad, config))


def test_float8_tensor_without_scale(fp8, tmp_path):
    """A float8 weight whose weight_scale_inv is absent: CheckpointError naming the weight."""
    directory = fp8.directory
    tensors = load_file(str(directory / "model.safetensors"))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    del tensors[name + "_scale_inv"]
    path = write_checkpoint(tmp_path / "ckpt", tensors, config_of(directory))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_model(path)


def test_float8_tensor_without_quantization_config(fp8, tmp_path):
    """A float8 tensor in a checkpoint whose config.json has no quantization_config: an error
    naming the tensor (the scale would otherwise be ignored)."""
    directory = fp8.directory
    config = config_of(directory)
    del config["quantization_config"]
    path = write_checkpoint(tmp_path / "ckpt", load_file(str(directory / "model.safetensors")),
                            config)
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    assert "quantization_config" in str(err.value)
    assert "model.layers." in str(err.value) and ".weight" in str(err.value)


def test_float8_of_another_format_is_refused(fp8, tmp_path):
    """A float8_e5m2 weight (config says e4m3) is refused naming the tensor, not loaded as if it
    needed no scale."""
    directory = fp8.directory
    tensors = load_file(str(directory / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].float().to(torch.float8_e5m2)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_model(write_checkpoint(tmp_path / "ckpt", tensors, config_of(directory)))


# ---------------------------------------------------------------------------------------------
# MTP layers
# ---------------------------------------------------------------------------------------------


def add_mtp(tensors: dict[str, torch.Tensor], n_layers: int, hidden: int) -> dict:
    """DeepSeek-V3-style multi-token-prediction layer ``model.layers.{n_layers}.*``: a copy of the
    last decoder layer plus enorm/hnorm/eh_proj/shared_head."""
    mtp = dict(tensors)
    last = f"model.layers.{n_layers - 1}."
    for k, v in tensors.items():
        if k.startswith(last):
            mtp[f"model.layers.{n_layers}." + k[len(last):]] = v.clone()
    g = torch.Generator().manual_seed(9)
    extra = {"enorm.weight": (hidden,), "hnorm.weight": (hidden,), "eh_proj.weight": (hidden,
                                                                                      2 * hidden),
             "shared_head.norm.weight": (hidden,), "shared_head.head.weight": (VOCAB, hidden)}
    for k, shape in extra.items():
        mtp[f"model.layers.{n_layers}.{k}"] = torch.randn(shape, generator=g)
    return mtp


@pytest.mark.parametrize("name", sorted(CASES))
def test_mtp_layer_is_skipped(saved, tmp_path, name):
    """Tensors of layer index num_hidden_layers (MTP: enorm/hnorm/eh_proj/shared_head + a full
    layer) are skipped; loading succeeds and the logits equal transformers' (single and sharded)."""
    hf, directory, ref = saved[name]
    config = dict(config_of(directory), num_nextn_predict_layers=1)
    tensors = add_mtp(read_all(directory), 3, 64)
    assert any(k.startswith("model.layers.3.") for k in tensors)
    single = write_checkpoint(tmp_path / "single", tensors, config)
    model = load_model(single)
    assert len(model.model.layers) == 3
    assert_logits_equal(model.logits(IDS), ref)
    # sharded: the MTP layer in its own shard, as in DeepSeek-V3 (model-00163-of-000163)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    main = {k: v for k, v in tensors.items() if not k.startswith("model.layers.3.")}
    mtp = {k: v for k, v in tensors.items() if k not in main}
    files = {"model-00001-of-00002.safetensors": main, "model-00002-of-00002.safetensors": mtp}
    for fname, part in files.items():
        save_file(part, str(sharded / fname), metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, part in files.items() for k in part}}))
    (sharded / "config.json").write_text(json.dumps(config))
    assert_logits_equal(load_model(sharded).logits(IDS), ref)


def test_mtp_fp8_layer_without_scales_is_skipped(fp8, tmp_path):
    """An FP8 checkpoint's MTP layer is skipped before any dequantization (even a float8 MTP
    tensor lacking its scale does not matter)."""
    directory, expected = fp8.directory, fp8.expected
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(72, 144).to(torch.float8_e4m3fn)
    path = write_checkpoint(tmp_path / "ckpt", tensors, config_of(directory))
    state = unfused(load_model(path).state_dict())
    assert torch.equal(state["model.layers.2.self_attn.o_proj.weight"],
                       expected["model.layers.2.self_attn.o_proj.weight"])


# ---------------------------------------------------------------------------------------------
# errors naming the tensor
# ---------------------------------------------------------------------------------------------


def _broken(saved, tmp_path, edit) -> Path:
    _, directory, _ = saved["v3"]
    tensors = read_all(directory)
    edit(tensors)
    return write_checkpoint(tmp_path / "broken", tensors, config_of(directory))


@pytest.mark.parametrize("victim", ["model.layers.1.self_attn.kv_b_proj.weight",
                                    "model.layers.2.mlp.experts.7.up_proj.weight",
                                    "model.layers.1.mlp.gate.e_score_correction_bias",
                                    "model.norm.weight", "lm_head.weight"])
def test_missing_tensor_is_named(saved, tmp_path, victim):
    """Deleting one tensor: CheckpointError 'missing' naming it."""
    path = _broken(saved, tmp_path, lambda t: t.pop(victim))
    with pytest.raises(CheckpointError, match="missing") as err:
        load_model(path)
    assert victim in str(err.value)


def test_many_missing_tensors_are_summarised(saved, tmp_path):
    """A checkpoint missing a whole layer: the error names some and counts the rest."""
    path = _broken(saved, tmp_path, lambda t: [t.pop(k) for k in list(t)
                                               if k.startswith("model.layers.2.")])
    with pytest.raises(CheckpointError, match=r"missing tensors model\.layers\.2\..*more"):
        load_model(path)


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.foo.weight",
                                   "model.layers.1.mlp.experts.8.gate_proj.weight",
                                   "model.layers.0.mlp.experts.0.gate_proj.weight"])
def test_unexpected_tensor_is_named(saved, tmp_path, extra):
    """An extra tensor the model has no parameter for: CheckpointError naming it."""
    path = _broken(saved, tmp_path, lambda t: t.__setitem__(extra, torch.zeros(24, 64)))
    with pytest.raises(CheckpointError, match="unexpected") as err:
        load_model(path)
    assert extra in str(err.value)


@pytest.mark.parametrize("victim,shape", [("model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                                           (64, 48)),
                                          ("model.layers.1.mlp.gate.weight", (7, 64)),
                                          ("model.embed_tokens.weight", (VOCAB + 1, 64))])
def test_misshaped_tensor_is_named(saved, tmp_path, victim, shape):
    """A tensor with the wrong shape: CheckpointError naming it, its shape and the expected one."""
    path = _broken(saved, tmp_path, lambda t: t.__setitem__(victim, torch.zeros(shape)))
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    message = str(err.value)
    assert victim in message and str(tuple(shape)) in message


def test_no_safetensors_files(saved, tmp_path):
    """A directory with config.json but no safetensors (e.g. only pytorch_model.bin): a
    CheckpointError naming the directory."""
    _, directory, _ = saved["v2"]
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(directory / "config.json", empty / "config.json")
    (empty / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="safetensors") as err:
        load_model(empty)
    assert str(empty) in str(err.value)


def test_index_naming_an_absent_shard(saved, tmp_path):
    """A sharded checkpoint with one shard missing (interrupted download): CheckpointError
    naming the absent file."""
    hf, _, _ = saved["v2"]
    directory = save(hf, tmp_path / "sharded", max_shard_size="20KB")
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError) as err:
        load_model(directory)
    assert shard.name in str(err.value)


# ---------------------------------------------------------------------------------------------
# dtype and tied embeddings
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_bf16_load_keeps_router_in_fp32(saved, name):
    """load_model(dtype=bfloat16): router gate weights (and V3 correction biases) stay float32,
    every other parameter is bf16; logits stay close to transformers' fp32 logits."""
    _, directory, ref = saved[name]
    model = load_model(directory, dtype=torch.bfloat16)
    routers = 0
    for key, p in model.named_parameters():
        if key.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias")):
            assert p.dtype == torch.float32, key
            routers += 1
        else:
            assert p.dtype == torch.bfloat16, key
    assert routers == (2 if name == "v2" else 4)
    logits = model.logits(IDS)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    scale = ref.abs().max().item()
    assert (logits - ref).abs().max().item() < 0.1 * scale
    cos = torch.nn.functional.cosine_similarity(logits.flatten(), ref.flatten(), dim=0)
    assert cos > 0.99
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("name", sorted(CASES))
def test_tied_word_embeddings(tmp_path, name):
    """tie_word_embeddings=True: transformers saves no lm_head.weight; the checkpoint loads,
    lm_head shares the embedding tensor, and logits equal transformers'."""
    hf = build_hf(CASES[name], seed=4, tie_word_embeddings=True)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    directory = save(hf, tmp_path / "tied")
    assert config_of(directory)["tie_word_embeddings"] is True
    assert "lm_head.weight" not in read_all(directory)
    model = load_model(directory)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, read_all(directory)["model.embed_tokens.weight"])
    assert_logits_equal(model.logits(IDS), hf_logits(hf))
    bf16 = load_model(directory, dtype=torch.bfloat16)
    assert bf16.lm_head.weight is bf16.model.embed_tokens.weight
    assert bf16.lm_head.weight.dtype == torch.bfloat16
