"""``irminsul.parallel.load_shard``: one rank's share read from the checkpoint equals the whole
model loaded and then split by ``shard_weights`` — every tensor bit for bit, the same sharded
config and expert range — for DeepSeek-V2 and V3 shapes, float32 and bf16, a many-file
checkpoint, an FP8 one and ones with attention biases; the row-parallel o_proj's bias is added
once over the ranks; and the routed experts of other ranks are never read."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")  # the checkpoints are written by transformers

# tests/model is on sys.path under pytest (rootdir-relative imports of test modules)
from test_model_loader import (  # noqa: E402
    CASES,
    FP8_QUANT,
    build_hf,
    config_of,
    fp8,
    is_quantized,
    quantize,
    read_all,
    save,
    write_checkpoint,
)

from irminsul.model import CheckpointError, load_model  # noqa: E402
from irminsul.model import loader as loader_module  # noqa: E402
from irminsul.model.moe import MoE  # noqa: E402
from irminsul.parallel.load import load_shard  # noqa: E402
from irminsul.parallel.shard import shard_weights  # noqa: E402

__all__ = ["fp8"]  # the imported module-scoped fixture, used below


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: directory}: V2 and V3 in one file, V3 in many (index.json + 20 KB shards), and V2
    and V3 with ``attention_bias: true`` (random biases ~ N(1, 0.2²) on kv_a_proj_with_mqa,
    o_proj and, V3's q-LoRA, q_a_proj)."""
    out = {}
    for name, case in CASES.items():
        out[name] = save(build_hf(case, seed=4), tmp_path_factory.mktemp(name))
        out[f"{name}_bias"] = save(build_hf(case, seed=6, attention_bias=True),
                                   tmp_path_factory.mktemp(f"{name}_bias"))
    out["v3_many_files"] = save(build_hf(CASES["v3"], seed=5),
                                tmp_path_factory.mktemp("many"), max_shard_size="20KB")
    return out


# A tiny FP8 V3 whose splits over 2 and 4 ranks fall on its 16 x 16 scale blocks (query rows
# 32 per head, o_proj columns 16 per head, MLP widths 128 and 64), so keep_fp8 can shard it.
FP8_ALIGNED = ("DeepseekV3", dict(q_lora_rank=32, intermediate_size=128, moe_intermediate_size=64,
                                  n_group=2, topk_group=1, norm_topk_prob=True,
                                  routed_scaling_factor=2.5,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


@pytest.fixture(scope="module")
def fp8_aligned(tmp_path_factory):
    plain = save(build_hf(FP8_ALIGNED, seed=7), tmp_path_factory.mktemp("fp8_aligned_src"))
    tensors = {}
    for name, t in read_all(plain).items():
        if is_quantized(name, t):
            tensors[name], tensors[name + "_scale_inv"] = quantize(t)
        else:
            tensors[name] = t
    return write_checkpoint(tmp_path_factory.mktemp("fp8_aligned"), tensors,
                            dict(config_of(plain), quantization_config=FP8_QUANT))


def assert_same_shard(path, rank: int, world: int, dtype: torch.dtype, *,
                      keep_fp8: bool = False, attention: str = "tensor") -> None:
    want = shard_weights(load_model(path, dtype=dtype, keep_fp8=keep_fp8), rank, world,
                         attention)
    got = load_shard(path, rank, world, dtype=dtype, keep_fp8=keep_fp8, attention=attention)
    assert got.config == want.config
    assert got.shard == want.shard == (rank, world)
    assert got.attention_mode == want.attention_mode == attention
    want_state, got_state = want.state_dict(), got.state_dict()
    assert want_state.keys() == got_state.keys()
    for name, tensor in want_state.items():
        assert got_state[name].dtype == tensor.dtype, name
        assert torch.equal(got_state[name], tensor), name
    for a, b in zip(want.modules(), got.modules()):
        if isinstance(a, MoE):
            assert a.expert_first == b.expert_first
    ids = torch.tensor([1, 5, 9, 3])
    # The rank's partial logits (no all-reduce on one process) agree too.
    assert torch.equal(got.logits(ids), want.logits(ids))


@pytest.mark.parametrize("name", ["v2", "v3", "v3_many_files", "v2_bias", "v3_bias"])
@pytest.mark.parametrize("world", [2, 4])
def test_shard_read_equals_load_then_shard(checkpoints, name: str, world: int) -> None:
    for rank in range(world):
        assert_same_shard(checkpoints[name], rank, world, torch.float32)
    assert_same_shard(checkpoints[name], world - 1, world, torch.bfloat16)


@pytest.mark.parametrize("name", ["v2", "v3_bias"])
def test_data_parallel_share_read_equals_load_then_shard(checkpoints, fp8_aligned,
                                                         name: str) -> None:
    """Under data-parallel attention a rank reads every weight whole (its o_proj bias too) but
    the routed experts of other ranks; float8 kept too."""
    for rank in range(4):
        assert_same_shard(checkpoints[name], rank, 4, torch.float32, attention="data")
    assert_same_shard(fp8_aligned, 1, 2, torch.float32, keep_fp8=True, attention="data")
    whole = load_model(checkpoints[name])
    share = load_shard(checkpoints[name], 1, 4, attention="data")
    attn, whole_attn = share.model.layers[0].self_attn, whole.model.layers[0].self_attn
    assert torch.equal(attn.o_proj.weight, whole_attn.o_proj.weight)
    if whole_attn.o_proj.bias is not None:
        assert torch.equal(attn.o_proj.bias, whole_attn.o_proj.bias)


@pytest.mark.parametrize("name", ["v2_bias", "v3_bias"])
@pytest.mark.parametrize("world", [2, 4])
def test_o_proj_bias_is_added_once(checkpoints, name: str, world: int) -> None:
    """With ``attention_bias: true``, against the whole model ``load_model`` reads (no sharding
    code): each layer's attention outputs of the ``load_shard`` ranks, summed, are the whole
    layer's (fp32 tolerance), which holds only if o_proj's bias (~1 per entry) is added once.
    The rule: o_proj is row-parallel, so rank 0 keeps its bias and every other rank a zero one;
    q_a_proj and kv_a_proj_with_mqa are replicated, biases whole on every rank (so every rank
    computes the same latent rows); q_proj, q_b_proj and kv_b_proj have no bias."""
    whole = load_model(checkpoints[name])
    ranks = [load_shard(checkpoints[name], rank, world) for rank in range(world)]
    tokens = 7
    x = torch.randn(tokens, whole.config.hidden_size, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(tokens)
    for i, layer in enumerate(whole.model.layers):
        attn = layer.self_attn
        assert attn.o_proj.bias is not None and bool(attn.o_proj.bias.abs().min() > 0.1), i
        parts = [shard.model.layers[i].self_attn for shard in ranks]
        with torch.inference_mode():
            want, rows = attn(x, positions, [None], [tokens])
            outs, part_rows = zip(*(part(x, positions, [None], [tokens]) for part in parts))
        assert all(torch.equal(r, rows) for r in part_rows), i
        torch.testing.assert_close(torch.stack(outs).sum(0), want, rtol=1e-5, atol=1e-5)
        assert [r for r, part in enumerate(parts) if part.o_proj.bias.any()] == [0], i
        assert torch.equal(parts[0].o_proj.bias, attn.o_proj.bias), i
        for part in parts:
            for proj in ("q_a_proj", "kv_a_proj_with_mqa"):
                if hasattr(attn, proj):
                    assert torch.equal(getattr(part, proj).bias, getattr(attn, proj).bias), proj
            for proj in ("q_proj", "q_b_proj", "kv_b_proj"):
                assert getattr(getattr(part, proj, None), "bias", None) is None, proj


def test_fp8_checkpoint_shard_equals_load_then_shard(fp8) -> None:
    """Float8 weights are dequantized whole, then sliced: the same as dequantize-at-load."""
    for rank in range(2):
        assert_same_shard(fp8.directory, rank, 2, torch.float32)


@pytest.mark.parametrize("world", [2, 4])
def test_fp8_kept_shard_equals_load_then_shard(fp8_aligned, world: int) -> None:
    """keep_fp8: each rank reads its float8 slices and their scale grids' rows or columns (and
    its experts as float8): bit-identical to loading whole with keep_fp8 and sharding — and its
    partial logits equal the dequantized share's, bit for bit (same per-element arithmetic)."""
    for rank in range(world):
        assert_same_shard(fp8_aligned, rank, world, torch.float32, keep_fp8=True)
    assert_same_shard(fp8_aligned, world - 1, world, torch.bfloat16, keep_fp8=True)
    kept = load_shard(fp8_aligned, 1, world, keep_fp8=True)
    dense = load_shard(fp8_aligned, 1, world)
    float8 = [n for n, p in kept.named_parameters() if p.dtype == torch.float8_e4m3fn]
    assert any(n.endswith("mlp.w13") for n in float8) and any("q_b_proj" in n for n in float8)
    assert sum(p.nbytes for p in kept.parameters()) < 0.6 * sum(p.nbytes for p in dense.parameters())
    ids = torch.tensor([1, 5, 9, 3, 40, 2])
    assert torch.equal(kept.logits(ids), dense.logits(ids))


def test_fp8_kept_shard_off_the_scale_blocks_is_refused(fp8) -> None:
    """The partial-block FP8 fixture: 2 heads of 28 query rows per rank are not whole 16-row
    blocks, so its scales would cover the other rank's rows: refused, the split named."""
    with pytest.raises(ValueError, match=r"attention's query rows: the share 56\.\.112 of 112 "
                                         r"does not fall on the float8 weight's 16-wide"):
        load_shard(fp8.directory, 1, 2, keep_fp8=True)
    with pytest.raises(ValueError, match="does not fall on the float8"):
        shard_weights(load_model(fp8.directory, keep_fp8=True), 1, 2)


def test_other_ranks_experts_are_never_read(checkpoints, monkeypatch) -> None:
    """Reads are recorded at the file handle: rank 0 of 2 reads experts 0..3 of each MoE layer
    and none of 4..7 (and every tensor it reads, it reads once)."""
    reads: list[str] = []
    real = loader_module.safe_open

    class Recording:
        def __init__(self, *args, **kwargs) -> None:
            self.inner = real(*args, **kwargs)

        def __enter__(self):
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_slice(self, name):
            view = self.handle.get_slice(name)

            class Slice:
                def get_dtype(self):
                    return view.get_dtype()

                def get_shape(self):  # the header's, as get_dtype: no tensor data read
                    return view.get_shape()

                def __getitem__(self, index):
                    reads.append(name)
                    return view[index]

            return Slice()

        def get_tensor(self, name):
            reads.append(name)
            return self.handle.get_tensor(name)

    monkeypatch.setattr(loader_module, "safe_open", Recording)
    load_shard(checkpoints["v2"], 0, 2)
    experts = [n for n in reads if ".mlp.experts." in n]
    assert experts and all(int(n.split(".experts.")[1].split(".")[0]) < 4 for n in experts)
    assert len(reads) == len(set(reads))


def test_refused_splits_and_ranks(checkpoints) -> None:
    with pytest.raises(ValueError, match="does not split evenly"):
        load_shard(checkpoints["v2"], 0, 3)
    with pytest.raises(ValueError, match="rank 2 is not one of 2"):
        load_shard(checkpoints["v2"], 2, 2)


def _without(source, tmp_path, pick) -> tuple:  # noqa: ANN001
    """A copy of checkpoint ``source`` without the first tensor whose name ``pick`` accepts."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    name = next(n for n in sorted(tensors) if pick(n))
    del tensors[name]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    return broken, name


def test_a_missing_dense_tensor_is_named(checkpoints, tmp_path) -> None:
    broken, name = _without(checkpoints["v2"], tmp_path,
                            lambda n: n.endswith("mlp.gate_proj.weight") and "layers.0." in n)
    with pytest.raises(CheckpointError, match=f"missing tensors {name}"):
        load_shard(broken, 0, 2)


@pytest.mark.parametrize("proj", ["gate", "up", "down"])
def test_a_missing_expert_tensor_is_named_by_the_rank_that_keeps_it(checkpoints, tmp_path,
                                                                    proj: str) -> None:
    """Expert 0 of a MoE layer is rank 0's of 2: rank 0 refuses the checkpoint, naming the
    tensor (its stacked row would otherwise hold whatever the allocation held); rank 1 never
    reads it and loads."""
    broken, name = _without(checkpoints["v2"], tmp_path,
                            lambda n: n.endswith(f"mlp.experts.0.{proj}_proj.weight"))
    with pytest.raises(CheckpointError, match=f"missing tensors {name}"):
        load_shard(broken, 0, 2)
    load_shard(broken, 1, 2)
    with pytest.raises(CheckpointError, match=f"missing tensors {name}"):
        load_model(broken)  # the whole model: the reference's own check


def test_a_loaded_share_is_not_split_again(checkpoints) -> None:
    """shard_model on a share load_shard read keeps it as it is (the follower's path); a share
    of another split is refused."""
    share = load_shard(checkpoints["v2"], 1, 2)
    before = {n: t.clone() for n, t in share.state_dict().items()}
    shard_weights(share, 1, 2)
    assert all(torch.equal(t, before[n]) for n, t in share.state_dict().items())
    with pytest.raises(ValueError,
                       match="rank 1 of 2's share \\(tensor-parallel attention\\), not rank 0 of 2's"):
        shard_weights(share, 0, 2)


def test_serve_keep_fp8_reaches_every_rank_load(fp8_aligned) -> None:
    """``serve --keep-fp8``: rank 0's load (``leader_load``) and a follower's (``FollowerSpec``'s
    config) read float8 shares."""
    from irminsul.cli import build_parser
    from irminsul.config import ParallelConfig, ServerConfig
    from irminsul.parallel.follower import Follower, FollowerSpec
    from irminsul.parallel.serving import leader_load

    assert build_parser().parse_args(["serve", "--keep-fp8"]).keep_fp8
    leader = leader_load(2, keep_fp8=True)(fp8_aligned, dtype=torch.float32, device="cpu")
    spec = FollowerSpec(1, ParallelConfig(world_size=2), "tcp://127.0.0.1:1", str(fp8_aligned),
                        ServerConfig(device="cpu", keep_fp8=True), 1, "/dev/null")
    follower = Follower(spec)._load("cpu")
    for model, rank in ((leader, 0), (follower, 1)):
        want = load_shard(fp8_aligned, rank, 2, keep_fp8=True).state_dict()
        got = model.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[n], t) for n, t in want.items())
        assert any(t.dtype == torch.float8_e4m3fn for t in got.values())
