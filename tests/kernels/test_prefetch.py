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

    monkeypatch.setattr(prefetch, "MAX_TOKENS", 16)
    build("v2_lite_like", tmp_path, layers=3)
    model = load_model(tmp_path, device=DEVICE)
    moe = _moes(model)[0]
    mlp = moe.shared_experts
    assert moe.known_weights(1) == ()  # kernels off: the torch path reads weights its own way
    moe.kernels = True
    want = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    for tokens in (1, prefetch.MAX_TOKENS):
        got = moe.known_weights(tokens)
        assert len(got) == 3 and all(g is w for g, w in zip(got, want))
    assert moe.known_weights(0) == ()
    assert moe.known_weights(prefetch.MAX_TOKENS + 1) == ()


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
