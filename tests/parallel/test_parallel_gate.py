"""The PIC gate under tensor parallel: rank 0 holds only its share of the model, and the gate's
three engines (full recomputation, PIC, naive reuse) run on every rank's shard through the
leader. On two gloo ranks it gives one process's figures and verdict on the embedded model,
and every engine it opened is closed on the followers."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
from parallel_ranks import run_ranks, values

from irminsul.config import GateConfig
from irminsul.model import default_model_dir, load_model
from irminsul.parallel import ParallelGroup, follow, leader_engine, load_shard, release, shard_model
from irminsul.parallel import leader as leader_module
from irminsul.quality import gate_probes, run_gate
from irminsul.traffic.render import ChatRenderer

PROBES = (0, 4)  # a document moved behind a new header; a compacted tool result (δ < 0)


def gate_on_ranks(group: ParallelGroup, cache_dir: str) -> dict:
    model = shard_model(load_shard(default_model_dir(), group.rank, group.world_size), group)
    if not group.leader:
        received = []  # the leader's messages as this rank's process receives them
        broadcast = leader_module.broadcast

        def recorded(*args, **kwargs):
            message = broadcast(*args, **kwargs)
            received.append(message[:2])
            return message

        leader_module.broadcast = recorded
        forwards = follow(model, group)
        opened = [channel for kind, channel in received if kind == leader_module.OPEN]
        closed = [channel for kind, channel in received if kind == leader_module.CLOSE]
        return dict(forwards=forwards, opened=opened, closed=closed)
    renderer = ChatRenderer.from_dir(default_model_dir())
    try:
        result = run_gate(model, renderer, "tp-test", GateConfig(cache_dir=cache_dir),
                          probes=[gate_probes()[i] for i in PROBES],
                          open_engine=partial(leader_engine, group=group))
    except BaseException as err:
        release(group, f"{type(err).__name__}: {err}")
        raise
    release(group)
    return dict(result=result, shard=model.shard)


def test_the_gate_runs_on_the_shards_and_measures_what_one_process_does(tmp_path: Path) -> None:
    leader, follower = values(run_ranks(gate_on_ranks, 2, str(tmp_path / "tp"), timeout_s=600))
    assert leader["shard"] == (0, 2)  # rank 0 never held the whole model
    assert follower["forwards"] > 0
    # Full recomputation, PIC, naive reuse: each opened on the follower, and each released.
    assert len(follower["opened"]) == 3 and sorted(follower["closed"]) == follower["opened"]
    one = run_gate(load_model(default_model_dir()), ChatRenderer.from_dir(default_model_dir()),
                   "one-process", GateConfig(cache_dir=str(tmp_path / "one")),
                   probes=[gate_probes()[i] for i in PROBES])
    tp = leader["result"]
    assert tp.passed and one.passed, (tp.reason, one.reason)
    for a, b in zip(tp.probes, one.probes, strict=True):
        assert ((a.name, a.prompt_tokens, a.pic_tokens, a.derived_tokens)
                == (b.name, b.prompt_tokens, b.pic_tokens, b.derived_tokens))
        assert a.reused
        # The ranks sum partial outputs in another order than one process: rounding only.
        assert a.kl_pic == pytest.approx(b.kl_pic, rel=1e-3, abs=1e-7)
        assert a.kl_naive == pytest.approx(b.kl_naive, rel=1e-3, abs=1e-7)
        assert (a.argmax_pic, a.argmax_naive) == (b.argmax_pic, b.argmax_naive)
        assert a.first_divergence_pic == b.first_divergence_pic
