"""bench serve's sessions: grouping a log by session, and each call's reply length from the log."""

from __future__ import annotations

import pytest

from irminsul.loadgen.sessions import build_sessions, group_sessions, reply_index, reply_tokens
from irminsul.loadgen.workloads import APPEND_ONLY, load_workload
from irminsul.model import default_model_dir
from irminsul.traffic.logs import Request
from irminsul.traffic.render import ChatRenderer

SYSTEM = {"role": "system", "content": "You are a booking agent."}
USER = {"role": "user", "content": "Change my flight to Denver."}
REPLY = {"role": "assistant", "content": "Which date would you like?"}
TOOL_CALL = {"role": "assistant", "content": "",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "search", "arguments": '{"to": "DEN"}'}}]}
TOOL = {"role": "tool", "tool_call_id": "c1", "content": "UA 123 at noon"}


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer.from_dir(default_model_dir())


def req(session: str, call: int, *messages: dict) -> Request:
    return Request(session, call, list(messages), None, source=f"test:{session}:{call}")


def test_sessions_in_order_of_first_appearance_calls_by_number() -> None:
    log = [req("b", 1, USER), req("a", 0, USER), req("b", 0, USER), req("a", 1, USER),
           req("c", 0, USER), req("b", 2, USER)]
    groups = group_sessions(log)
    assert [[(r.session, r.call) for r in g] for g in groups] == [
        [("b", 0), ("b", 1), ("b", 2)], [("a", 0), ("a", 1)], [("c", 0)]]
    # calls without numbers (all 0) keep log order
    same = group_sessions([req("s", 0, USER), req("s", 0, SYSTEM)])
    assert [r.messages[0]["role"] for r in same[0]] == ["user", "system"]


def test_reply_is_the_next_calls_first_new_assistant_message() -> None:
    first = req("s", 0, SYSTEM, USER)
    second = req("s", 1, SYSTEM, USER, TOOL_CALL, TOOL)
    third = req("s", 2, SYSTEM, USER, TOOL_CALL, TOOL, REPLY, USER)
    assert reply_index(first, second) == 2
    assert reply_index(second, third) == 4
    assert reply_index(third, third) is None  # nothing new: no logged reply
    # a call that carries a message the next one drops (rerank's documents) still finds it
    with_docs = req("s", 0, SYSTEM, USER, {"role": "user", "content": "[document 3] ..."})
    assert reply_index(with_docs, second) == 2


def test_reply_length_is_what_the_model_generates(renderer: ChatRenderer) -> None:
    """The default template renders an assistant message as <|assistant|>TEXT<|end|> and
    prompts with <|assistant|>: the model generates TEXT and <|end|>."""
    call = req("s", 1, SYSTEM, USER, REPLY, USER)
    expected = renderer.encode(REPLY["content"]).size + renderer.encode("<|end|>").size
    assert renderer.encode("<|end|>").size == 1
    assert reply_tokens(renderer, call, 2) == expected
    # tool calls count too: name and arguments on their own line after <|tool_call|>
    call = req("s", 1, SYSTEM, USER, TOOL_CALL, TOOL)
    text = "<|tool_call|>search\n" + TOOL_CALL["tool_calls"][0]["function"]["arguments"]
    assert reply_tokens(renderer, call, 2) == renderer.encode(text + "<|end|>").size


def test_build_sessions_cuts_and_defaults(renderer: ChatRenderer) -> None:
    log = [req("a", 0, SYSTEM, USER), req("a", 1, SYSTEM, USER, REPLY, USER),
           req("a", 2, SYSTEM, USER, REPLY, USER, REPLY, USER),
           req("b", 0, SYSTEM, USER), req("c", 0, SYSTEM, USER)]
    reply = reply_tokens(renderer, log[1], 2)
    sessions = build_sessions(log, renderer, default_reply=7)
    assert [s.name for s in sessions] == ["a", "b", "c"]
    a = sessions[0].calls
    assert [(c.session, c.index, c.max_tokens, c.logged_reply) for c in a] == [
        (0, 0, reply, True), (0, 1, reply, True), (0, 2, 7, False)]
    assert sessions[1].calls[0].max_tokens == 7 and not sessions[1].calls[0].logged_reply
    # the last kept call's reply still comes from the log's next call
    cut = build_sessions(log, renderer, sessions=1, calls=2, default_reply=7)
    assert len(cut) == 1 and [c.max_tokens for c in cut[0].calls] == [reply, reply]
    capped = build_sessions(log, renderer, sessions=1, default_reply=7, max_reply=3)
    assert [c.max_tokens for c in capped[0].calls] == [3, 3, 3]


def test_named_workloads(renderer: ChatRenderer) -> None:
    """agent_meta keeps its source's sessions (two asked for: two built), each call but the last
    answered by the log; the append-only sample's histories only grow."""
    sessions = build_sessions(load_workload("agent_meta", renderer, sessions=2), renderer,
                              sessions=2, calls=3)
    assert len(sessions) == 2 and all(s.name.startswith("agent_meta-") for s in sessions)
    assert all(c.logged_reply for s in sessions for c in s.calls)
    headers = {s.calls[0].request.messages[0]["content"][:40] for s in sessions}
    assert len(headers) == 2  # a persona per session
    append = group_sessions(load_workload(APPEND_ONLY, renderer))
    for group in append:
        for before, after in zip(group, group[1:]):
            assert after.messages[:len(before.messages)] == before.messages
    with pytest.raises(FileNotFoundError, match="nor a workload name"):
        load_workload("no-such-workload", renderer)


def test_reference_block_reaches_agent_sized_contexts(renderer: ChatRenderer) -> None:
    """--system-tokens N: every request's system prompt carries the same block of about N
    tokens after its own text, so prompts grow by about N tokens and the block is shared."""
    plain = load_workload("agent_meta", renderer, sessions=2)
    grown = load_workload("agent_meta", renderer, sessions=2, system_tokens=2000)
    assert len(plain) == len(grown)
    for a, b in zip(plain, grown):
        extra = (len(renderer.encode(b.messages[0]["content"]))
                 - len(renderer.encode(a.messages[0]["content"])))
        assert 1900 <= extra <= 2100
    tails = {r.messages[0]["content"][-500:] for r in grown}
    assert len(tails) == 1  # one block, shared
    with pytest.raises(ValueError, match="built patterns only"):
        load_workload(APPEND_ONLY, renderer, system_tokens=10)


def test_more_sessions_than_the_sample_holds(renderer: ChatRenderer) -> None:
    """Asked for more sessions than the tau-bench sample's 12, agent_meta replays its sessions
    again under new names: as many sessions as asked, each a copy of a source session's calls."""
    one_pass = group_sessions(load_workload("agent_meta", renderer))
    sessions = build_sessions(load_workload("agent_meta", renderer, sessions=30), renderer,
                              sessions=30)
    assert len(one_pass) == 12 and len(sessions) == 30
    assert len({s.name for s in sessions}) == 30
    for i, s in enumerate(sessions):
        assert len(s.calls) == len(one_pass[i % 12])
