"""Review: malformed request shapes in a log are reported as malformed lines (file:line), not a
traceback that aborts the whole analysis."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from irminsul.analysis.analyze import analyze_log
from irminsul.traffic.logs import LogError
from irminsul.traffic.render import ChatRenderer

GOOD = {"session": "a", "messages": [{"role": "user", "content": "hello there"}]}
BAD = {
    "text_null": {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
    "text_number": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    "tool_calls_str": {"messages": [{"role": "assistant", "content": "x", "tool_calls": "f"}]},
    "tool_call_str": {"messages": [{"role": "assistant", "content": "x", "tool_calls": ["f"]}]},
    "tool_without_function": {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]},
    "lone_surrogate": {"messages": [{"role": "user", "content": "\ud800"}]},
}


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer.default()


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("kind", sorted(BAD))
def test_unrenderable_line_is_skipped_and_named(tmp_path: Path, renderer: ChatRenderer,
                                                kind: str, workers: int) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(b) for b in (GOOD, BAD[kind], GOOD)) + "\n")
    report = analyze_log(log, renderer, progress=False, workers=workers)
    assert report["requests"] == 2  # both good lines, the bad one skipped
    assert len(report["malformed_lines"]) == 1
    assert report["malformed_lines"][0].startswith(f"{log}:2: ")
    with pytest.raises(LogError, match=f"{log}:2: "):
        analyze_log(log, renderer, progress=False, workers=workers, strict=True)


# -- partition-shift workloads built from logs whose messages carry content parts -----------------

def _parts(text: str) -> list[dict]:
    return [{"type": "text", "text": text}]


@pytest.mark.parametrize("pattern", ["agent_meta", "sysvar"])
def test_workload_keeps_a_system_prompt_given_as_content_parts(renderer: ChatRenderer,
                                                               pattern: str) -> None:
    from irminsul.traffic.logs import Request
    from irminsul.traffic.workloads import TextPool, build_workload

    pool = TextPool(["word " * 600], renderer)
    system = "You are a travel agent. Follow the policy.\nBe brief."
    body = Request("s", 0, [{"role": "system", "content": _parts(system)},
                            {"role": "user", "content": "hi"}], None, source="x:1")
    built = next(iter(build_workload(pattern, [body], pool, requests=1, header_tokens=4)))
    content = built["messages"][0]["content"]
    if pattern == "agent_meta":  # header, request line, then the system prompt
        assert content.endswith("\n\n" + system)
    else:  # the system prompt with the request line on its own line inside it
        lines = content.split("\n")
        assert "\n".join(line for line in lines if not line.startswith("request-id")) == system


def test_compacted_tool_result_given_as_content_parts(renderer: ChatRenderer) -> None:
    from irminsul.traffic.logs import Request
    from irminsul.traffic.workloads import KEEP_TOOL_RESULTS, TextPool, build_workload

    pool = TextPool(["word " * 600], renderer)
    tool = [{"role": "tool", "content": _parts(f"result {i}"), "tool_call_id": str(i)}
            for i in range(KEEP_TOOL_RESULTS + 1)]
    body = Request("s", 0, [{"role": "user", "content": "hi"}, *tool], None, source="x:1")
    built = next(iter(build_workload("compact", [body], pool, requests=1)))
    assert built["messages"][1]["content"] == "[compacted tool result, 8 chars] result 0"


# -- message fields a model's own chat template reads --------------------------------------------

REASONING_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}</{{ m.role }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_template_sees_the_message_fields_it_reads(renderer: ChatRenderer) -> None:
    """A template that renders assistant ``reasoning_content`` (as Qwen3's and DeepSeek-R1's
    do) gets it: the prompt is the template's text, and two messages that differ only there
    are not one memo entry."""
    custom = ChatRenderer(renderer.tokenizer, REASONING_TEMPLATE, name="reasoning")
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
                {"role": "user", "content": "and 3+3?"}]
    expected = ("<user>2+2?</user><assistant><think>two and two</think>4</assistant>"
                "<user>and 3+3?</user><assistant>")
    assert custom.render_text(messages, generation=True) == expected
    assert custom.tokenizer.decode(custom.render(messages).tokens.tolist()) == expected
    other = [messages[0], {**messages[1], "reasoning_content": "2 + 2"}, messages[2]]
    assert "<think>2 + 2</think>" in custom.tokenizer.decode(custom.render(other).tokens.tolist())
