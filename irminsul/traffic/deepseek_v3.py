"""The built-in DeepSeek-V3-style chat template, and the same template written out in Python.

The Jinja template is the definition. Rendering it is what a generic template needs: the renderer
renders ``messages[:i+1]`` whole to learn message i's text, so a conversation of n messages costs
O(n²) message renders, and a sandboxed attribute lookup each time (most of ``analyze``'s render
time on a long agent log). This template renders each message from that message alone (and from
whether it is the first, and the tools), so :func:`message_text` writes one message's text
directly, in time linear in the message.

:func:`message_text` must give exactly the template's text. It handles the fields as real logs and
the server's requests carry them (strings, lists and objects as JSON gives them) and returns None
for anything else (a tool name that is a number, a tool without ``function``, ...): the renderer
then renders that message with the template, which decides what such a message means (or raises).
``tests/traffic/test_render.py`` checks both against a full Jinja render of every prefix.
"""

from __future__ import annotations

import json

# DeepSeek-V3-style template, rendered strictly in message order (so it is incremental); the tool
# schemas follow the first message (the system prompt), DeepSeek-V3.1 style, since V3's own template
# drops them. Text after a block tag sits inside {{ }} so trim_blocks cannot eat its newlines.
DEEPSEEK_V3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' or message.role == 'developer' %}{{ message.content }}"
    "{%- endif %}"
    "{%- if loop.first and tools %}"
    "{{ '\\n\\n## Tools\\n\\nYou have access to the following tools:' }}"
    "{%- for tool in tools %}"
    "{{ '\\n\\n### ' + tool.function.name + '\\nDescription: ' + (tool.function.description or '')"
    " + '\\n\\nParameters: ' + (tool.function.parameters | tojson) }}"
    "{%- endfor %}"
    "{{ '\\n\\n' }}"
    "{%- endif %}"
    "{%- if message.role == 'user' %}<｜User｜>{{ message.content }}"
    "{%- elif message.role == 'assistant' %}<｜Assistant｜>{{ message.content }}"
    "{%- if message.tool_calls %}<｜tool▁calls▁begin｜>"
    "{%- for call in message.tool_calls %}<｜tool▁call▁begin｜>{{ call.type or 'function' }}"
    "<｜tool▁sep｜>{{ call.function.name }}\n```json\n{{ call.function.arguments }}\n```"
    "<｜tool▁call▁end｜>{%- endfor %}<｜tool▁calls▁end｜>{%- endif %}<｜end▁of▁sentence｜>"
    "{%- elif message.role == 'tool' %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>"
    "{{ message.content }}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)

# What the template appends for add_generation_prompt.
GENERATION = "<｜Assistant｜>"

_ROLE_TEXT = {"system": ("", ""), "developer": ("", ""), "user": ("<｜User｜>", ""),
              "tool": ("<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>",
                       "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")}


def message_text(message: dict, first: bool, tools: list[dict] | None) -> str | None:
    """The text the template adds for ``message`` (normalised as the renderer normalises it:
    content as text, tool-call arguments as JSON text), ``first`` when it is ``messages[0]``;
    None when a field is of a kind only the template itself should interpret."""
    role, content = message["role"], message["content"]
    if not isinstance(content, str):
        return None
    parts: list[str] = []
    if role in ("system", "developer"):
        parts.append(content)
    if first and tools:
        preamble = _tools_text(tools)
        if preamble is None:
            return None
        parts.append(preamble)
    if role == "assistant":
        calls = _calls_text(message.get("tool_calls"))
        if calls is None:
            return None
        parts += ("<｜Assistant｜>", content, calls, "<｜end▁of▁sentence｜>")
    elif role in ("user", "tool"):
        head, tail = _ROLE_TEXT[role]
        parts += (head, content, tail)
    elif role not in _ROLE_TEXT:
        return None  # an unknown role: the template renders nothing, or whatever it decides
    return "".join(parts)


def _tools_text(tools: list) -> str | None:
    parts = ["\n\n## Tools\n\nYou have access to the following tools:"]
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or "parameters" not in function:
            return None
        name, description = function.get("name"), function.get("description")
        if not isinstance(name, str) or not (description is None or isinstance(description, str)):
            return None
        # tojson is Hugging Face's: json.dumps with the keys in their order, no HTML escaping.
        parts += ("\n\n### ", name, "\nDescription: ", description or "", "\n\nParameters: ",
                  json.dumps(function["parameters"], ensure_ascii=False))
    parts.append("\n\n")
    return "".join(parts)


def _calls_text(calls: object) -> str | None:
    if not calls:
        return ""
    if not isinstance(calls, list):
        return None
    parts = ["<｜tool▁calls▁begin｜>"]
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            return None
        kind, name, arguments = call.get("type"), function.get("name", ""), \
            function.get("arguments", "")
        # A missing field prints as nothing in Jinja, None as "None": only strings pass here.
        if not (kind is None or isinstance(kind, str)) or not isinstance(name, str) \
                or not isinstance(arguments, str):
            return None
        parts += ("<｜tool▁call▁begin｜>", kind or "function", "<｜tool▁sep｜>", name,
                  "\n```json\n", arguments, "\n```<｜tool▁call▁end｜>")
    parts.append("<｜tool▁calls▁end｜>")
    return "".join(parts)
