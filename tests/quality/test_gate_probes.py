"""The gate's probe set: the three kinds of partition shift, cut the same way every time from the
shipped samples, each re-sending content of its seen request at other positions."""

from __future__ import annotations

from collections import Counter

from irminsul.model.default import default_model_dir
from irminsul.quality import PROBE_KINDS, gate_probes
from irminsul.traffic.prompt import render_prompt
from irminsul.traffic.render import ChatRenderer


def test_two_probes_of_each_kind_with_distinct_names() -> None:
    probes = gate_probes()
    assert Counter(p.kind for p in probes) == {kind: 2 for kind in PROBE_KINDS}
    assert len({p.name for p in probes}) == len(probes)


def test_the_probe_set_is_deterministic() -> None:
    assert gate_probes() == gate_probes()


def test_moved_content_is_not_an_exact_prefix() -> None:
    """Each moved request diverges from its seen request hundreds of tokens before its end
    (after a shared system prompt at most for a moved document or a changed header, at the
    rewritten result for a tool result), so an exact-prefix cache cannot serve what follows;
    what PIC serves of it is asserted by test_gate.py's
    test_every_probe_is_served_by_pic_past_the_carve_out."""
    renderer = ChatRenderer.from_dir(default_model_dir())
    for probe in gate_probes():
        seen, moved = (render_prompt(renderer, r.messages, r.tools).tokens
                       for r in (probe.seen, probe.moved))
        common = next((i for i, (a, b) in enumerate(zip(seen, moved)) if a != b),
                      min(seen.size, moved.size))
        assert common < moved.size - 300, probe.name
        assert 400 <= moved.size <= 1200 and seen.size <= 1200, probe.name


def test_a_follow_up_is_its_moved_conversation_one_turn_on() -> None:
    """Two probes carry a follow-up: moved's messages, then the next turn's. Rendered, it starts
    with moved's whole prompt (so an engine serves it moved's rows) and adds a turn of its own."""
    renderer = ChatRenderer.from_dir(default_model_dir())
    with_follow_up = [p for p in gate_probes() if p.follow_up is not None]
    assert {p.kind for p in with_follow_up} == {"moved_document", "rewritten_tool_result"}
    for probe in with_follow_up:
        assert probe.follow_up.messages[:len(probe.moved.messages)] == probe.moved.messages
        moved, follow = (render_prompt(renderer, r.messages, r.tools).tokens
                         for r in (probe.moved, probe.follow_up))
        assert (follow[:moved.size] == moved).all(), probe.name
        assert moved.size + 100 <= follow.size <= 1600, probe.name
