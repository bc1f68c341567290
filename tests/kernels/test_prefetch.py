"""The shared experts warmed into L2 during a decode step's attention: which forwards warm which
weights (hand-stated), and that warming changes nothing a forward computes."""

from __future__ import annotations

import pytest
import torch
from fixtures.tiny_models import build

from irminsul.config import EngineConfig
from irminsul.engine import Engine, SamplingParams, Scheduler
from irminsul.model import load_model
from irminsul.model.moe import MoE

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _moes(model) -> list[MoE]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]


def test_known_weights_are_the_shared_mlp_at_decode_sizes(tmp_path, monkeypatch) -> None:
    from irminsul.kernels import prefetch
    from irminsul.model.model import warming

    monkeypatch.setattr(prefetch, "MAX_TOKENS", 16)
    assert [warming(t) for t in (0, 1, 16, 17)] == [(False, False), (True, False),
                                                      (True, False), (False, False)]
    monkeypatch.setattr(prefetch, "FOLLOWING", True)
    assert [warming(t) for t in (1, 17)] == [(True, True), (False, False)]
    build("v2_lite_like", tmp_path, layers=3)
    model = load_model(tmp_path, device=DEVICE)
    moe = _moes(model)[0]
    mlp = moe.shared_experts
    assert moe.known_weights() == ()  # kernels off: the torch path reads weights its own way
    moe.kernels = True
    got = moe.known_weights()
    want = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    assert len(got) == 3 and all(g is w for g, w in zip(got, want))
    monkeypatch.setattr(prefetch, "WITH_DOWN", False)
    assert moe.known_weights() == want[:2]


def test_decode_forwards_warm_every_moe_layer_and_compute_the_same(tmp_path, monkeypatch) -> None:
    """Every MoE layer's decode forwards hand its shared MLP's weights and its attention's o_proj
    to the prefetch, and the
    tokens generated with warming on are those with it off (MAX_TOKENS 0: no call at all)."""
    from irminsul.kernels import prefetch

    build("v2_lite_like", tmp_path, layers=3)
    model = load_model(tmp_path, device=DEVICE)
    calls: list[tuple[int, ...]] = []
    real = prefetch.warm

    def record(tensors) -> None:
        calls.append(tuple(t.data_ptr() for t in tensors))
        real(tensors)

    monkeypatch.setattr(prefetch, "warm", record)
    monkeypatch.setattr(prefetch, "MAX_TOKENS", 16)
    prompts = [torch.arange(40) % 97, (torch.arange(25) * 7) % 97]

    def generate() -> list[list[int]]:
        engine = Engine(model, EngineConfig(slots=400, mode="off", kernels=True))
        scheduler = Scheduler(engine, batch_tokens=128, chunk_tokens=64)
        ids = [scheduler.add(p.numpy(), SamplingParams(max_tokens=6)) for p in prompts]
        outs: dict[int, list[int]] = {i: [] for i in ids}
        while scheduler.has_work():
            for out in scheduler.step():
                outs[out.request_id] += out.new_tokens
        return [outs[i] for i in ids]

    warmed = generate()
    # Each MoE layer's shared gate, up and down, then that layer's own o_proj.
    shared = {tuple(w.data_ptr() for w in (
        layer.mlp.shared_experts.gate_proj.weight, layer.mlp.shared_experts.up_proj.weight,
        layer.mlp.shared_experts.down_proj.weight, layer.self_attn.o_proj.weight))
        for layer in model.model.layers if isinstance(layer.mlp, MoE)}
    assert len(shared) == 2 and set(calls) == shared
    calls.clear()
    monkeypatch.setattr(prefetch, "MAX_TOKENS", 0)
    assert generate() == warmed
    assert calls == []


def test_following_warms_the_next_layers_joint_projection(tmp_path, monkeypatch) -> None:
    """With FOLLOWING on, each MoE layer but the last also hands the next layer's joint q/kv_a
    weight to the prefetch (before its router); the last layer has none to hand."""
    from irminsul.kernels import prefetch

    build("v2_lite_like", tmp_path, layers=3)
    model = load_model(tmp_path, device=DEVICE)
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(prefetch, "warm", lambda ts: calls.append(tuple(t.data_ptr() for t in ts)))
    monkeypatch.setattr(prefetch, "MAX_TOKENS", 16)
    monkeypatch.setattr(prefetch, "FOLLOWING", True)
    engine = Engine(model, EngineConfig(slots=200, mode="off", kernels=True))
    scheduler = Scheduler(engine, batch_tokens=64, chunk_tokens=64)
    scheduler.add((torch.arange(30) % 97).numpy(), SamplingParams(max_tokens=3))
    while scheduler.has_work():
        scheduler.step()
    layers = model.model.layers
    joint = layers[2].self_attn._joined()
    assert joint is not None  # kernels on join the two projections
    assert (joint["weight"].data_ptr(),) in calls
    singles = {c for c in calls if len(c) == 1}
    assert singles == {(joint["weight"].data_ptr(),)}  # layer 1's MoE only: layer 2 is last


def test_warm_rejects_what_it_cannot_prefetch() -> None:
    from irminsul.kernels import prefetch

    with pytest.raises(ValueError, match="up to 4 tensors"):
        prefetch.warm([torch.zeros(4)] * 5)
    with pytest.raises(ValueError, match="tensor 1 .* strides"):
        prefetch.warm([torch.zeros(4), torch.zeros(4, 4).t()])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="prefetches run on CUDA only")
def test_warm_replays_from_a_graph_and_changes_nothing() -> None:
    from irminsul.kernels import prefetch

    tensors = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in (3, 70_001, 1 << 20)]
    before = [t.clone() for t in tensors]
    prefetch.warm(tensors)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prefetch.warm(tensors)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
