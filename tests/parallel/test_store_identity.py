"""The shared store's model identity under tensor parallel: rank 0's share of a model names it as
the whole model does, at every world size up to a host's eight GPUs, so engines serving one
checkpoint at different sizes share the store; and it still follows the weights."""

from __future__ import annotations

import pytest
import torch
from tiny_parallel import tiny_model

from irminsul.parallel import shard_weights
from irminsul.parallel.shard import split_dims
from irminsul.store.keys import model_identity

CASES = ["v2_lite_like", "v3_like"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world", [2, 4])
def test_split_dims_name_what_shard_weights_splits(case: str, world: int) -> None:
    """Checked against shard_weights itself: a weight split_dims names is, on rank 0, the whole
    weight's leading 1/world along that dimension; every other weight is whole."""
    whole = tiny_model(case).state_dict()
    dims = split_dims(tiny_model(case))
    share = shard_weights(tiny_model(case), 0, world).state_dict()
    assert dims and share.keys() == whole.keys()
    for name, tensor in whole.items():
        if name in dims:
            size = tensor.shape[dims[name]] // world
            assert torch.equal(share[name], tensor.narrow(dims[name], 0, size)), name
        else:
            assert torch.equal(share[name], tensor), name
    assert split_dims(shard_weights(tiny_model(case), 0, world)) == dims


@pytest.mark.parametrize("case", CASES)
def test_rank_zero_names_the_whole_model(case: str) -> None:
    expected = model_identity(tiny_model(case), torch.bfloat16)
    for world in (2, 4):
        assert model_identity(shard_weights(tiny_model(case), 0, world), torch.bfloat16) == expected
    # Still the weights' identity: another seed, or one changed value in the part of a split
    # weight every rank 0 holds, is another model at any size.
    other = tiny_model(case, seed=1)
    assert model_identity(other, torch.bfloat16) != expected
    changed = tiny_model(case)
    with torch.no_grad():
        changed.model.layers[1].self_attn.o_proj.weight[0, 0] += 1.0
    assert model_identity(shard_weights(changed, 0, 2), torch.bfloat16) != expected


def test_a_larger_world_is_refused() -> None:
    model = tiny_model("v2_lite_like", num_attention_heads=16, num_key_value_heads=16,
                       n_routed_experts=16, moe_intermediate_size=32)
    with pytest.raises(ValueError, match="up to 8, not 16"):
        model_identity(shard_weights(model, 0, 16), torch.bfloat16)


def test_a_data_parallel_share_is_refused() -> None:
    """Each data-parallel rank holds other experts: its sample would name another model."""
    with pytest.raises(ValueError, match="not a data-parallel one: give StoreConfig.model_id"):
        model_identity(shard_weights(tiny_model("v3_like"), 1, 2, "data"), torch.bfloat16)
