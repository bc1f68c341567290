"""The gate's probe set: content an agent re-sends at new positions, built from the shipped samples.

A probe is a pair of chat requests served in order: ``seen`` puts some content in the cache,
``moved`` sends the same content again where an exact-prefix cache cannot serve it, so PIC reuses
it rotated by δ. Three kinds, two probes each (one from each shipped sample log), the partition
shifts agents cause most often:

    moved_document         retrieved documents re-ranked: the same records in another order,
                           as messages of their own (region hits) or inside one message (chunks)
    changed_header         a per-agent header of another length before the shared system prompt
                           and conversation (δ > 0)
    rewritten_tool_result  an earlier tool result compacted, so everything after it moves back
                           (δ < 0)

Two probes also carry a ``follow_up``: the next turn of the moved conversation (a reply and the
user's next message after it), served after ``moved``. Its prefix is moved's own rows, which an
exact-prefix match serves — but rows computed over reused content (a *derived* prefix): the
error a second turn inherits from the first turn's reuse, which the moved requests alone never
show.

Everything is cut deterministically from the shipped samples (irminsul/data/samples, MIT; their
license notices are kept beside them there) by session, message index and character count, plus
a few header lines of the kind an assembler adds. Nothing here depends on a tokenizer: the probes
are rendered with the checkpoint's own, so they measure that checkpoint on its own tokens. Each
request is a few hundred to ~1,500 tokens of the embedded model's tokenizer: long enough that PIC
reuses hundreds of tokens past the carve-out, short enough that the gate takes seconds on a CPU.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

from ..traffic.logs import Request, read_requests, sample_logs

ProbeKind = Literal["moved_document", "changed_header", "rewritten_tool_result"]
PROBE_KINDS: tuple[ProbeKind, ...] = ("moved_document", "changed_header", "rewritten_tool_result")

# The sessions the probes are cut from, one per shipped sample (its longest call is used).
TAU_SESSION, SWE_SESSION = "task0-trial0", "django__django-14765"


@dataclass(frozen=True)
class Probe:
    """Two requests served in order: ``moved`` re-sends ``seen``'s content at other positions;
    ``follow_up``, where there is one, is moved's conversation one turn on, served after it."""

    name: str
    kind: ProbeKind
    seen: Request
    moved: Request
    follow_up: Request | None = None


def _longest_call(requests: list[Request], session: str) -> list[dict]:
    """The messages of a session's longest call (every earlier call is a prefix of it)."""
    calls = [r for r in requests if r.session == session]
    if not calls:
        raise ValueError(f"the shipped samples hold no session {session!r}; the gate's probes "
                         "are cut from it")
    return copy.deepcopy(max(calls, key=lambda r: len(r.messages)).messages)


def _cut(text: str, chars: int) -> str:
    """At most ``chars`` characters of ``text``, ending at a line end where one is near."""
    if len(text) <= chars:
        return text
    end = text.rfind("\n", chars // 2, chars)
    return text[:end if end > 0 else chars]


def _message(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def _compacted(text: str) -> str:
    """A tool result as a compacting agent rewrites it (workloads.py's ``compact`` pattern)."""
    return f"[compacted tool result, {len(text)} chars] {text[:160]}"


def _request(name: str, part: str, messages: list[dict]) -> Request:
    call = {"seen": 0, "moved": 1, "follow-up": 2}[part]
    return Request(session=f"gate-{name}", call=call, messages=messages, tools=None,
                   source=f"probe {name} ({part})")


def _probe(name: str, kind: ProbeKind, seen: list[dict], moved: list[dict],
           next_turn: list[dict] | None = None) -> Probe:
    """A probe; ``next_turn``: the messages its follow-up adds after moved's."""
    follow_up = None if next_turn is None else _request(name, "follow-up",
                                                        copy.deepcopy(moved) + next_turn)
    return Probe(name, kind, _request(name, "seen", seen), _request(name, "moved", moved),
                 follow_up)


def gate_probes() -> list[Probe]:
    """The probe set, in the order the gate serves it (deterministic: the same every call)."""
    tau_log, swe_log = (list(read_requests(path, strict=True)) for path in sample_logs())
    tau, swe = _longest_call(tau_log, TAU_SESSION), _longest_call(swe_log, SWE_SESSION)
    policy = _cut(tau[0]["content"], 1200)
    swe_system, issue = swe[0]["content"], _cut(swe[1]["content"], 1200)
    records = [_cut(tau[i]["content"], 700) for i in (7, 9, 29)]  # tool results
    outputs = [_cut(swe[i]["content"], 700) for i in (5, 11, 21)]  # command outputs
    probes = []

    # moved_document: records re-ranked behind a new one, as messages of their own (found as
    # whole regions)...
    ask = _message("user", "Using only the records above, which flight did the customer book?")
    system = _message("system", "You are an airline support agent. Records from the booking "
                                "system follow, most relevant first.")
    probes.append(_probe(
        "tau-records-reranked", "moved_document",
        [system, *(_message("user", r) for r in records[:2]), ask],
        [system, *(_message("user", r) for r in (records[2], records[1], records[0])), ask]))
    # ...and command outputs re-ranked inside one message (found chunk by chunk).
    intro = "Relevant output from earlier commands, most relevant first:\n\n"
    probes.append(_probe(
        "swe-outputs-reranked", "moved_document",
        [_message("system", swe_system), _message("user", intro + "\n\n".join(outputs[:2])),
         _message("user", "Which file has to change? Answer with its path.")],
        [_message("system", swe_system),
         _message("user", intro + "\n\n".join([outputs[2], outputs[1], outputs[0]])),
         _message("user", "Which file has to change? Answer with its path.")],
        [_message("assistant", _cut(swe[10]["content"], 400)),
         _message("user", "Which function in that file has to change? Answer with its name.")]))

    # changed_header: a per-agent header line before the shared system prompt and conversation,
    # short in one request and long (a persona paragraph) in the other.
    short = "agent: airline-desk-1 | request-id: 3f9c2a1e07 | time: 2024-05-15T15:00:00-05:00"
    long = ("agent: airline-desk-7 (escalations) | request-id: 9b07d4c2e6a15f08 | time: "
            "2024-05-15T15:07:31-05:00\nThis desk handles escalated cases: be patient, confirm "
            "every change with the customer before making it, and never promise compensation "
            "the policy does not allow. Escalated customers have usually spoken to another "
            "agent already; do not ask again for details they gave in the conversation.")
    turns = tau[1:6]
    probes.append(_probe(
        "tau-agent-header", "changed_header",
        [_message("system", f"{short}\n\n{policy}"), *turns],
        [_message("system", f"{long}\n\n{policy}"), *turns]))
    probes.append(_probe(
        "swe-agent-header", "changed_header",
        [_message("system", f"{long}\n\n{swe_system}"), _message("user", issue), *swe[2:5]],
        [_message("system", f"{short}\n\n{swe_system}"), _message("user", issue), *swe[2:5]]))

    # rewritten_tool_result: an early tool result compacted; the turns after it move back.
    conversation = [system, *tau[1:7], _message("tool", records[0]), *tau[8:12]]
    compacted = copy.deepcopy(conversation)
    compacted[7]["content"] = _compacted(records[0])
    # Its next turn, as the log goes on: a tool call, its result, the reply, the user's answer.
    next_turn = [*copy.deepcopy(tau[12:13]), _message("tool", _cut(tau[13]["content"], 700)),
                 _message("assistant", _cut(tau[14]["content"], 400)), *copy.deepcopy(tau[15:16])]
    probes.append(_probe("tau-tool-result-compacted", "rewritten_tool_result", conversation,
                         compacted, next_turn))
    session = [_message("system", swe_system), _message("user", issue), *swe[2:5],
               _message("user", outputs[0]), _message("assistant", _cut(swe[6]["content"], 500)),
               *swe[7:11]]
    rewritten = copy.deepcopy(session)
    rewritten[5]["content"] = _compacted(outputs[0])
    probes.append(_probe("swe-output-compacted", "rewritten_tool_result", session, rewritten))
    return probes
