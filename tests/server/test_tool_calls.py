"""Tool calls read out of replies: the syntax learned from each chat template against the syntax
written out by hand, and replies split into content and calls against hand-written answers,
token by token and all at once (streamed and non-streamed must agree)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fixtures.tiny_server_model import build
from tokenizers import AddedToken, Tokenizer

from irminsul.engine.scheduler import StepOutput
from irminsul.server.async_engine import EngineSnapshot
from irminsul.server.generation import Generation
from irminsul.server.metrics import ServerMetrics
from irminsul.server.tool_calls import ToolCallDelta, ToolCallReader, ToolSyntax
from irminsul.traffic.render import ChatRenderer

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "irminsul" / "default_model"
TOOLS = ("get_weather", "search")

# A DeepSeek-V3.1-style template (written for this test): no type and no fence, the content
# before the calls.
V31_STYLE = (
    "{{ bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ '<｜User｜>' + m.content }}"
    "{%- elif m.role == 'assistant' %}{{ '<｜Assistant｜>' + (m.content or '') }}"
    "{%- if m.tool_calls %}{{ '<｜tool▁calls▁begin｜>' }}{%- for c in m.tool_calls %}"
    "{{ '<｜tool▁call▁begin｜>' + c.function.name + '<｜tool▁sep｜>' + c.function.arguments"
    " + '<｜tool▁call▁end｜>' }}{%- endfor %}{{ '<｜tool▁calls▁end｜>' }}{%- endif %}"
    "{{ '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{%- endif %}")
# Calls in plain text (no added tokens): the opening is recognised as its run of token ids.
PLAIN = (
    "{%- for m in messages %}{{ m.role + ': ' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{ ' [[call ' + c.function.name + ']] '"
    " + c.function.arguments + ' [[/call]]' }}{%- endfor %}{{ '\\n' }}{%- endfor %}")


def _deepseek_tokenizer() -> Tokenizer:
    return ChatRenderer.default().tokenizer


@pytest.fixture(scope="module")
def syntaxes() -> dict[str, tuple[ToolSyntax, Tokenizer]]:
    embedded = ChatRenderer.from_dir(DEFAULT_MODEL)
    v3 = ChatRenderer.default()
    v31 = ChatRenderer(v3.tokenizer, V31_STYLE, bos_token="<｜begin▁of▁sentence｜>")
    plain = ChatRenderer(v3.tokenizer, PLAIN)
    out = {}
    for name, renderer in (("embedded", embedded), ("v3", v3), ("v31", v31), ("plain", plain)):
        syntax = ToolSyntax.learn(renderer)
        assert syntax is not None, name
        out[name] = (syntax, renderer.tokenizer)
    return out


def test_the_syntax_is_read_off_each_template(syntaxes) -> None:
    """What each template writes around a call, against the templates read by hand."""
    tokenizer = _deepseek_tokenizer()
    expected = {
        "embedded": ("", "<|tool_call|>", "\n", "", ""),
        "v3": ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>",
               "\n```json\n", "\n```<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"),
        "v31": ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"),
        "plain": ("", " [[call ", "]] ", " [[/call]]", ""),
    }
    for name, (syntax, _) in syntaxes.items():
        assert (syntax.begin, syntax.call_begin, syntax.name_end, syntax.call_end,
                syntax.end) == expected[name], name
    # The DeepSeek markers are added tokens: the first alone opens the calls.
    assert syntaxes["v3"][0].trigger == (tokenizer.token_to_id("<｜tool▁calls▁begin｜>"),)
    embedded = ChatRenderer.from_dir(DEFAULT_MODEL).tokenizer
    assert syntaxes["embedded"][0].trigger == (embedded.token_to_id("<|tool_call|>"),)
    # A plain-text opening: its ids but the last, which merges with the name after it.
    assert syntaxes["plain"][0].trigger == tuple(tokenizer.encode(" [[call ").ids[:-1])
    assert len(syntaxes["plain"][0].trigger) > 1


def test_a_template_that_writes_no_calls_has_no_syntax() -> None:
    renderer = ChatRenderer(_deepseek_tokenizer(),
                            "{%- for m in messages %}{{ m.role + ': ' + m.content }}{%- endfor %}")
    assert ToolSyntax.learn(renderer) is None


def _reply(name: str, syntax: ToolSyntax, content: str, calls: list[tuple[str, str]]) -> str:
    """A reply as the model would write it, in ``syntax``."""
    parts = [content, syntax.begin]
    for call_name, arguments in calls:
        parts += [syntax.call_begin, call_name, syntax.name_end, arguments, syntax.call_end]
    return "".join(parts + [syntax.end])


def _stop_ids(tokenizer: Tokenizer) -> list[int]:
    """The end-of-reply ids of either tokenizer (the server's stop ids)."""
    return [i for t in ("<|eos|>", "<｜end▁of▁sentence｜>")
            if (i := tokenizer.token_to_id(t)) is not None]


def _read(syntax: ToolSyntax, tokenizer: Tokenizer, ids: list[int], chunk: int
          ) -> tuple[str, list[dict]]:
    """Content text and calls of ``ids`` fed ``chunk`` ids at a time (content ids decoded as
    the server decodes them, skipping special tokens)."""
    reader = ToolCallReader(syntax, tokenizer, TOOLS, _stop_ids(tokenizer),
                            request_id="chatcmpl-test")
    content_ids: list[int] = []
    steps: list[str | ToolCallDelta] = []
    for i in range(0, len(ids), chunk):
        content_ids += reader.push(ids[i:i + chunk])
        steps += reader.take()
    content_ids += reader.finish()
    steps += reader.take()
    text = tokenizer.decode(content_ids, skip_special_tokens=True)
    calls: list[dict] = []
    for step in steps:
        if isinstance(step, str):
            text += step
        elif step.name is not None:
            assert step.index == len(calls) and step.arguments == ""
            calls.append({"name": step.name, "arguments": ""})
        else:
            calls[step.index]["arguments"] += step.arguments
    return text, calls


@pytest.mark.parametrize("name", ["embedded", "v3", "v31", "plain"])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_replies_split_into_content_and_calls(syntaxes, name: str, chunk: int) -> None:
    syntax, tokenizer = syntaxes[name]
    args1, args2 = '{"city": "Paris", "unit": "C"}', '{"q": "trains to Lyon \\u00e9"}'
    cases = [
        ("Let me check.", [("get_weather", args1)]),
        ("", [("get_weather", args1), ("search", args2)]),
        ("Plain answer, no calls.", []),
    ]
    for content, calls in cases:
        text = _reply(name, syntax, content, calls) if calls else content
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        got_text, got_calls = _read(syntax, tokenizer, ids, chunk)
        assert got_text == content
        # The arguments as generated; the embedded syntax has no call end, so its arguments
        # run to the next call and are taken as written.
        assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == \
            [(n, json.loads(a)) for n, a in calls]


@pytest.mark.parametrize("name", ["embedded", "v3", "v31", "plain"])
def test_calls_that_break_the_syntax_come_back_as_content(syntaxes, name: str) -> None:
    syntax, tokenizer = syntaxes[name]
    args = '{"city": "Oslo"}'
    # A name that is not one of the request's tools: the whole block is content.
    text = _reply(name, syntax, "Hi. ", [("delete_everything", args)])
    got_text, got_calls = _read(syntax, tokenizer, tokenizer.encode(text).ids, 2)
    assert got_calls == []
    assert got_text == "Hi. " + text[len("Hi. "):]
    # A good first call and a bad second one: the first is a call, the rest content.
    text = _reply(name, syntax, "", [("search", args), ("nope", args)])
    got_text, got_calls = _read(syntax, tokenizer, tokenizer.encode(text).ids, 1)
    assert [c["name"] for c in got_calls] == ["search"]
    assert json.loads(got_calls[0]["arguments"]) == json.loads(args)
    assert got_text.startswith(syntax.call_begin) and "nope" in got_text


class _Handle:
    """A request handle that replays scripted step outputs."""

    def __init__(self, outputs: list[StepOutput]) -> None:
        self.prompt_tokens = 3
        self.aborted: list[str] = []
        self._outputs = iter(outputs)

    def abort(self, reason: str = "abort") -> None:
        self.aborted.append(reason)

    def __aiter__(self) -> _Handle:
        return self

    async def __anext__(self) -> StepOutput:
        try:
            return next(self._outputs)
        except StopIteration:
            raise StopAsyncIteration from None


def _generation(ids: list[int], tokenizer: Tokenizer, syntax: ToolSyntax | None,
                stops: list[str], reason: str = "stop") -> Generation:
    outputs = [StepOutput("r", [t], i == len(ids) - 1, reason if i == len(ids) - 1 else None,
                          None, 0.0) for i, t in enumerate(ids)]
    reader = None if syntax is None else ToolCallReader(
        syntax, tokenizer, TOOLS, _stop_ids(tokenizer), request_id="chatcmpl-x")
    return Generation(_Handle(outputs), tokenizer, [], stops,
                      ServerMetrics(lambda: EngineSnapshot()), tool_calls=reader)


def _generate(ids: list[int], tokenizer: Tokenizer, syntax: ToolSyntax | None,
              stops: list[str], reason: str = "stop") -> tuple[list, str | None]:
    generation = _generation(ids, tokenizer, syntax, stops, reason)

    async def run() -> list:
        return [piece async for piece in generation.deltas()]

    return asyncio.run(run()), generation.finish_reason


def test_generation_streams_calls_and_ends_with_tool_calls(syntaxes) -> None:
    syntax, tokenizer = syntaxes["embedded"]
    eos = tokenizer.token_to_id("<|eos|>")
    text = "Checking. " + _reply("embedded", syntax, "", [("get_weather", '{"city": "Rome"}')])
    ids = tokenizer.encode(text).ids + [eos]
    pieces, reason = _generate(ids, tokenizer, syntax, [])
    assert reason == "tool_calls"
    assert "".join(p for p in pieces if isinstance(p, str)) == "Checking. "
    steps = [p for p in pieces if isinstance(p, ToolCallDelta)]
    assert steps[0].name == "get_weather" and steps[0].id and steps[0].arguments == ""
    assert len(steps) > 2  # the arguments streamed in pieces, not at the end
    assert json.loads("".join(s.arguments for s in steps)) == {"city": "Rome"}
    # Without tools the same reply is text, as before: the marker (a special token) skipped.
    pieces, reason = _generate(ids, tokenizer, None, [])
    assert reason == "stop" and pieces and all(isinstance(p, str) for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_reply_cut_at_max_tokens_keeps_length_and_stop_strings_end_content(syntaxes) -> None:
    syntax, tokenizer = syntaxes["embedded"]
    text = _reply("embedded", syntax, "", [("search", '{"q": "a long query that is cut')])
    pieces, reason = _generate(tokenizer.encode(text).ids, tokenizer, syntax, [], "length")
    assert reason == "length"  # the call is there, cut short, as OpenAI returns it
    assert [p.name for p in pieces if isinstance(p, ToolCallDelta)][0] == "search"
    # A stop string in the content ends the reply before any call.
    text = "Stop HERE now. " + _reply("embedded", syntax, "", [("search", '{"q": 1}')])
    pieces, reason = _generate(tokenizer.encode(text).ids, tokenizer, syntax, ["HERE"])
    assert reason == "stop" and "".join(pieces) == "Stop "


def test_the_whole_reply_carries_the_calls_as_a_message_does(syntaxes) -> None:
    syntax, tokenizer = syntaxes["v3"]
    eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    text = _reply("v3", syntax, "On it.", [("get_weather", '{"city": "Rome"}'),
                                           ("search", '{"q": "Rome trains"}')])
    generation = _generation(tokenizer.encode(text).ids + [eos], tokenizer, syntax, [])
    content, calls = asyncio.run(generation.reply())
    assert content == "On it." and generation.finish_reason == "tool_calls"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [("function", "get_weather", {"city": "Rome"}),
                                ("function", "search", {"q": "Rome trains"})]
    assert len({c["id"] for c in calls}) == 2 and all("index" not in c for c in calls)


def test_a_required_call_opens_in_the_prompt_and_the_reply_names_the_tool(syntaxes) -> None:
    syntax, tokenizer = syntaxes["v31"]
    eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    # tool_choice "required": the prompt ends with the opening; the reply starts at the name.
    reply = "search" + syntax.name_end + '{"q": "x"}' + syntax.call_end + syntax.end
    reader = ToolCallReader(syntax, tokenizer, TOOLS, [eos], request_id="r", forced="")
    assert reader.reading
    assert reader.push(tokenizer.encode(reply).ids + [eos]) == [] and reader.finish() == []
    steps = reader.take()
    assert steps[0].name == "search" and "".join(s.arguments for s in steps) == '{"q": "x"}'
    # A named tool: the reply starts at the arguments, the call announced before any token.
    reader = ToolCallReader(syntax, tokenizer, TOOLS, [eos], request_id="r", forced="search")
    assert [s.name for s in reader.take()] == ["search"]
    assert syntax.opening("search") == ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search"
                                        "<｜tool▁sep｜>")


def test_a_call_forced_after_an_open_reasoning_block_closes_it_first() -> None:
    """An R1-style generation prompt ends with "<think>\n": a required call is opened after
    "</think>" and the blank line such replies put there, not inside the reasoning; a
    generation prompt that opens no block (V3.1's non-thinking one) gets the opening alone."""
    v3 = ChatRenderer.default()
    r1_style = V31_STYLE.replace("{{ '<｜Assistant｜>' }}{%- endif %}",
                                 "{{ '<｜Assistant｜><think>\\n' }}{%- endif %}")
    assert r1_style != V31_STYLE
    thinking = ToolSyntax.learn(ChatRenderer(v3.tokenizer, r1_style))
    plain = ToolSyntax.learn(ChatRenderer(v3.tokenizer, V31_STYLE))
    opening = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>"
    assert thinking.forced_opening("search") == "</think>\n\n" + opening
    assert plain.forced_opening("search") == opening
    closed = r1_style.replace("<think>\\n", "<think>\\n\\n</think>\\n\\n")
    closed_syntax = ToolSyntax.learn(ChatRenderer(v3.tokenizer, closed))
    assert closed_syntax.forced_opening("search") == opening


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The server tests' tiny model, its template writing calls as <|tool|>NAME\nARGS (the
    shared fixture's writes none: other tests' prompts stay as they are)."""
    directory = build(tmp_path_factory.mktemp("tiny-tool-model"))
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text("utf-8"))
    config["chat_template"] = config["chat_template"].replace(
        "{{ message.content }}", "{{ message.content }}{% for call in message.tool_calls or [] %}"
        "<|tool|>{{ call.function.name }}\n{{ call.function.arguments }}{% endfor %}")
    path.write_text(json.dumps(config), "utf-8")
    return directory


def _tool_request(server, **kw):
    tools = [{"type": "function", "function": {"name": name, "description": "d",
                                               "parameters": {"type": "object"}}}
             for name in TOOLS]
    return server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "weather in Oslo?"}],
        tools=tools, max_tokens=12, temperature=0, **kw)


def test_a_named_tool_choice_is_served_as_a_call_streamed_or_not(server) -> None:
    """Over HTTP with the tiny model: the reply to a named tool_choice is that tool's call, its
    arguments whatever the model wrote, the same streamed and not."""
    choice = {"type": "function", "function": {"name": "search"}}
    reply = _tool_request(server, tool_choice=choice)
    message = reply.choices[0].message
    assert message.content is None and reply.choices[0].finish_reason == "length"
    [call] = message.tool_calls
    assert call.function.name == "search" and call.type == "function" and call.id
    assert call.function.arguments and reply.usage.completion_tokens == 12
    chunks = list(_tool_request(server, tool_choice=choice, stream=True))
    streamed = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert streamed[0].function.name == "search" and streamed[0].id.startswith("call_")
    assert "".join(c.function.arguments or "" for c in streamed) == call.function.arguments
    assert not any(chunk.choices[0].delta.content for chunk in chunks)
    # tool_choice "none": the same request is answered in text, from a prompt without the
    # call's opening.
    plain = _tool_request(server, tool_choice="none")
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    opening = ChatRenderer.from_dir(server.model_dir).encode("<|tool|>search\n")
    assert reply.usage.prompt_tokens == plain.usage.prompt_tokens + len(opening)
    server.check()


# Whitespace around calls, as real templates write it (these written for the tests): "\n"
# before every call but the first (DeepSeek-V3's own template); "\n" before the calls only
# after content, markers that are added tokens but not special (Qwen's style).
V3_NEWLINES = V31_STYLE.replace(
    "{%- for c in m.tool_calls %}{{ '<｜tool▁call▁begin｜>'",
    "{%- for c in m.tool_calls %}{{ ('\\n' if not loop.first else '') + '<｜tool▁call▁begin｜>'")
QWEN_STYLE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.content %}{{ m.content }}{%- endif %}"
    "{%- for c in m.tool_calls or [] %}"
    "{{ '\\n' if m.content or not loop.first else '' }}{{ '<tool_call>\\n{\"name\": \"' +"
    " c.function.name + '\", \"arguments\": ' + c.function.arguments + '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def _qwen_like_tokenizer() -> Tokenizer:
    """DeepSeek's BPE with Qwen-style added tokens (no Qwen tokenizer ships here)."""
    tokenizer = Tokenizer.from_str(_deepseek_tokenizer().to_str())
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in ("<|im_start|>", "<|im_end|>")])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t in ("<tool_call>", "</tool_call>")])
    return tokenizer


def _calls_of(syntax: ToolSyntax, tokenizer: Tokenizer, text: str, stop: int
              ) -> tuple[str, list[tuple[str, dict]], str | None]:
    ids = tokenizer.encode(text, add_special_tokens=False).ids + [stop]
    reader = ToolCallReader(syntax, tokenizer, TOOLS, [stop], request_id="r")
    generation = Generation(_Handle([StepOutput("r", [t], i == len(ids) - 1,
                                                "stop" if i == len(ids) - 1 else None, None,
                                                0.0) for i, t in enumerate(ids)]),
                            tokenizer, [], [], ServerMetrics(lambda: EngineSnapshot()),
                            tool_calls=reader)
    content, calls = asyncio.run(generation.reply())
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in calls], generation.finish_reason


def test_whitespace_templates_write_around_calls_is_not_part_of_the_syntax() -> None:
    deepseek = _deepseek_tokenizer()
    renderer = ChatRenderer(deepseek, V3_NEWLINES)
    syntax = ToolSyntax.learn(renderer)
    assert syntax is not None and syntax.call_end == "<｜tool▁call▁end｜>"
    eos = deepseek.token_to_id("<｜end▁of▁sentence｜>")
    text = renderer.render_text([{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": "On it.", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": '{"q": "a"}'}},
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": '{"city": "Oslo"}'}}]}])
    reply = text.split("<｜Assistant｜>", 1)[1].removesuffix("<｜end▁of▁sentence｜>")
    assert _calls_of(syntax, deepseek, reply, eos) == (
        "On it.", [("search", {"q": "a"}), ("get_weather", {"city": "Oslo"})], "tool_calls")

    qwen = _qwen_like_tokenizer()
    syntax = ToolSyntax.learn(ChatRenderer(qwen, QWEN_STYLE))
    assert syntax is not None and syntax.trigger == (qwen.token_to_id("<tool_call>"),)
    end = qwen.token_to_id("<|im_end|>")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    # A reply that is only a call; then one after content, whose "\n" merges with the text
    # before it ("check.\n" is one token), with a second call.
    assert _calls_of(syntax, qwen, call, end) == (
        "", [("get_weather", {"city": "Paris"})], "tool_calls")
    content, calls, _ = _calls_of(syntax, qwen, "Let me check.\n" + call + "\n"
                                  + call.replace("Paris", "Oslo"), end)
    assert content.strip() == "Let me check."
    assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]


def test_a_template_that_cannot_render_the_sample_call_has_no_syntax() -> None:
    """A template iterating a call's arguments as a mapping raises TypeError on the sample's
    JSON text: the server starts without reading calls, rather than not at all."""
    template = ("{%- for m in messages %}{{ m.content }}{%- for c in m.tool_calls or [] %}"
                "{%- for k, v in c.function.arguments | items %}{{ k }}={{ v }}{%- endfor %}"
                "{%- endfor %}{%- endfor %}")
    assert ToolSyntax.learn(ChatRenderer(_deepseek_tokenizer(), template)) is None


def test_stop_strings_apply_to_text_the_reader_returns_as_content(syntaxes) -> None:
    syntax, tokenizer = syntaxes["v31"]
    eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    # A call of a tool the request does not offer, then ReAct-style text: all content, cut at
    # the stop string, and the request stopped there.
    text = ("Thought. " + syntax.opening("lookup") + '{"x": 1}' + syntax.call_end + syntax.end
            + "\nObservation: made up\nThought: more")
    ids = tokenizer.encode(text).ids + [eos]
    generation = _generation(ids, tokenizer, syntax, ["Observation:"], "length")
    content, calls = asyncio.run(generation.reply())
    assert calls == [] and content == text[:text.index("Observation:")]
    assert generation.finish_reason == "stop" and "stop" in generation.handle.aborted
    # Text after the calls is cut at a stop string too.
    text = syntax.opening("search") + '{"q": 1}' + syntax.call_end + syntax.end + "Done. STOP x"
    generation = _generation(tokenizer.encode(text).ids + [eos], tokenizer, syntax, ["STOP"])
    content, calls = asyncio.run(generation.reply())
    assert [c["function"]["name"] for c in calls] == ["search"] and content == "Done. "


@pytest.mark.parametrize("name", ["embedded", "v3"])
def test_parallel_tool_calls_false_ends_the_reply_after_its_first_call(syntaxes,
                                                                         name: str) -> None:
    syntax, tokenizer = syntaxes[name]
    text = _reply(name, syntax, "Two calls.", [("search", '{"q": 1}'), ("get_weather", '{}')])
    ids = tokenizer.encode(text).ids + _stop_ids(tokenizer)[:1]
    outputs = [StepOutput("r", [t], i == len(ids) - 1, "stop" if i == len(ids) - 1 else None,
                          None, 0.0) for i, t in enumerate(ids)]
    handle = _Handle(outputs)
    reader = ToolCallReader(syntax, tokenizer, TOOLS, _stop_ids(tokenizer), request_id="r",
                            max_calls=1)
    generation = Generation(handle, tokenizer, [], [], ServerMetrics(lambda: EngineSnapshot()),
                            tool_calls=reader)
    content, calls = asyncio.run(generation.reply())
    assert content == "Two calls." and generation.finish_reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("search", {"q": 1})]
    assert "stop" in handle.aborted  # the rest of the reply is not generated


# Qwen's and GLM's templates show each tool as JSON (this one written for the test).
TOOLS_AS_JSON = (
    "{{ bos_token }}{%- if tools %}{{ '<|system|>' }}{%- for tool in tools %}"
    "{{ tool | tojson }}{{ '\\n' }}{%- endfor %}{{ '<|end|>' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|' + m.role + '|>' + m.content + '<|end|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{%- endif %}")


def test_tools_reach_the_template_as_the_client_sent_them() -> None:
    """A template that shows whole tools as JSON renders the request's tools as transformers'
    apply_chat_template does: their keys in the client's order (the OpenAI SDK's
    pydantic_function_tool puts "strict" before "parameters"), nulls kept."""
    from transformers import AutoTokenizer

    from irminsul.server.prompts import chat_prompt
    from irminsul.server.protocol import ChatCompletionRequest, parse

    tools = [
        {"type": "function", "function": {
            "name": "get_weather", "strict": True,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"], "additionalProperties": False}}},
        {"function": {"name": "search", "description": None, "parameters": {}},
         "type": "function"},
    ]
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    body = parse(ChatCompletionRequest, {"model": "m", "messages": messages, "tools": tools})
    renderer = ChatRenderer.from_dir(DEFAULT_MODEL)
    renderer = ChatRenderer(renderer.tokenizer, TOOLS_AS_JSON, bos_token="<|bos|>")
    reference = AutoTokenizer.from_pretrained(DEFAULT_MODEL).apply_chat_template(
        messages, tools=tools, chat_template=TOOLS_AS_JSON, add_generation_prompt=True,
        tokenize=True, return_dict=False)
    assert chat_prompt(renderer, body).tokens == list(reference)


def test_a_function_without_parameters_renders_as_vllm_renders_it() -> None:
    """OpenAI lets a function omit ``parameters`` (it takes none). Templates that write
    ``tool.function.parameters | tojson`` (the embedded model's, DeepSeek-V3-style) failed on
    the undefined value with a 400; the tool reaches them with ``"parameters": null``, as vLLM
    hands it over: the prompt is transformers' rendering of that tool."""
    from transformers import AutoTokenizer

    from irminsul.server.prompts import chat_prompt
    from irminsul.server.protocol import ChatCompletionRequest, parse
    from irminsul.traffic.render import DEEPSEEK_V3_TEMPLATE

    sent = [{"type": "function", "function": {"name": "now", "description": "the time"}}]
    filled = [{"type": "function", "function": {"name": "now", "description": "the time",
                                                "parameters": None}}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "time?"}]
    body = parse(ChatCompletionRequest, {"model": "m", "messages": messages, "tools": sent})
    embedded = ChatRenderer.from_dir(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    reference = tokenizer.apply_chat_template(messages, tools=filled, add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
    assert chat_prompt(embedded, body).tokens == list(reference)
    assert "Parameters: null" in tokenizer.decode(list(reference))
    # The DeepSeek-V3-style template, rendered message by message: the same text as Jinja's.
    deepseek = ChatRenderer(embedded.tokenizer, DEEPSEEK_V3_TEMPLATE, bos_token="<|bos|>")
    tokenizer.bos_token = "<|bos|>"
    text = tokenizer.apply_chat_template(messages, tools=filled, add_generation_prompt=True,
                                         chat_template=DEEPSEEK_V3_TEMPLATE, tokenize=False)
    assert deepseek.render_text(messages, body.template_tools, generation=True) == text
