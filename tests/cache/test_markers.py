"""Tests for irminsul.cache.markers: S2 boundary markers with the default DeepSeek tokenizer.

The tokenizer comes from ``ChatRenderer.default()``. Marker positions are checked against a naive
sliding-window comparison written here, never against ``find_markers`` itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from irminsul.cache.markers import MARKER_BODY, MARKER_TEXT, assemble, find_markers
from irminsul.traffic.render import ChatRenderer


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer.default()


@pytest.fixture(scope="module")
def body(renderer) -> np.ndarray:
    return renderer.encode(MARKER_BODY)


def naive_occurrences(tokens: list[int], marker: list[int]) -> list[int]:
    """Start offsets of non-overlapping occurrences, scanning left to right, taking each match
    that does not overlap the last one taken."""
    out, w, i = [], len(marker), 0
    while w and i + w <= len(tokens):
        if tokens[i:i + w] == marker:
            out.append(i)
            i += w
        else:
            i += 1
    return out


def naive_resets(tokens, marker) -> list[int]:
    starts = naive_occurrences(list(tokens), list(marker))
    return sorted(starts + [s + len(marker) for s in starts])


# Real-looking prompt fragments: prose, trailing punctuation / spaces / newlines, CJK, code, JSON,
# digits, emoji, leading whitespace, empty text.
TEXTS = [
    "You are a helpful coding assistant.",
    "Summarise the following document:",
    "Here is the file:  ",
    "Note the trailing newline\n",
    "two newlines\n\n",
    "  leading spaces and a tab\t",
    "请根据以下文档回答问题。",
    "日本語のテキスト、カタカナ",
    "def f(x):\n    return x * 2\n",
    "```python\nimport numpy as np\nprint(np.arange(10))\n```",
    '{"name": "search", "arguments": {"q": "irminsul"}}',
    "Version 3.14159 released in 2024!",
    "emoji 🎉🎉 end",
    "\nstarts with a newline",
    "ends with a question?",
    "",
    "x",
    "<html><body>Hi</body></html>",
    "Windows line end\r\n",
]


def test_marker_body_is_64_tokens(renderer, body):
    """MARKER_BODY encodes to exactly 64 tokens: IR MIN SU L, then ĠIR MIN SU L fifteen times;
    MARKER_TEXT is that body between blank lines."""
    assert body.size == 64
    pieces = [renderer.tokenizer.id_to_token(int(t)) for t in body]
    assert pieces == ["IR", "MIN", "SU", "L"] + ["ĠIR", "MIN", "SU", "L"] * 15
    assert MARKER_TEXT == "\n\n" + MARKER_BODY + "\n\n"
    assert MARKER_BODY.split(" ") == ["IRMINSUL"] * 16


@pytest.mark.parametrize("a", TEXTS)
def test_marker_survives_any_left_context(renderer, body, a):
    """assemble([(a, False), (b, True), (c, False)]) encodes with the marker body at exactly two
    places, for every a in the pool (and a few b, c); find_markers returns exactly their start and
    end offsets (naive sliding comparison)."""
    for b, c in [(TEXTS[0], TEXTS[8]), (TEXTS[6], TEXTS[3]), (TEXTS[9], ""), ("", TEXTS[11])]:
        tokens = renderer.encode(assemble([(a, False), (b, True), (c, False)]))
        starts = naive_occurrences(tokens.tolist(), body.tolist())
        assert len(starts) == 2, (a, b, c)
        got = find_markers(tokens, body)
        assert got.dtype == np.int64
        assert got.tolist() == [starts[0], starts[0] + 64, starts[1], starts[1] + 64]


@pytest.mark.parametrize("b", TEXTS)
def test_shared_region_tokens_independent_of_context(renderer, body, b):
    """The tokens between the two markers around shared region b are the same whatever text a comes
    before and whatever c comes after, equal to encoding the marked region on its own, and decode
    to b between blank lines."""
    alone = renderer.encode(assemble([(b, True)]))
    r = find_markers(alone, body).tolist()
    assert len(r) == 4 and r[0] == naive_occurrences(alone.tolist(), body.tolist())[0]
    expected = alone[r[1]:r[2]].tolist()
    assert renderer.tokenizer.decode(expected) == "\n\n" + b + "\n\n"
    for a in TEXTS[::3]:
        for c in TEXTS[1::5]:
            tokens = renderer.encode(assemble([(a, False), (b, True), (c, False)]))
            resets = naive_resets(tokens.tolist(), body.tolist())
            assert len(resets) == 4
            assert tokens[resets[1]:resets[2]].tolist() == expected, (a, c)
            # The marker chunk plus the region is the same too: what S2 relies on.
            assert tokens[resets[0]:resets[3]].tolist() == alone[r[0]:r[3]].tolist()


_fragment = st.one_of(st.sampled_from(TEXTS), st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=st.lists(_fragment, max_size=4).map("".join),
       b=st.lists(_fragment, max_size=4).map("".join),
       c=st.lists(_fragment, max_size=4).map("".join))
def test_marker_robust_to_arbitrary_text(renderer, body, a, b, c):
    """For arbitrary unicode a, b, c (not containing the marker word), the marker body shows up at
    exactly two places, find_markers reports them, and the region between them does not depend on
    a or c."""
    if "IRMINSUL" in a + b + c:
        return
    tokens = renderer.encode(assemble([(a, False), (b, True), (c, False)]))
    resets = naive_resets(tokens.tolist(), body.tolist())
    assert len(resets) == 4
    assert find_markers(tokens, body).tolist() == resets
    alone = renderer.encode(assemble([(b, True)]))
    ra = naive_resets(alone.tolist(), body.tolist())
    assert tokens[resets[1]:resets[2]].tolist() == alone[ra[1]:ra[2]].tolist()


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), max_size=40), marker=st.lists(st.integers(0, 2),
                                                                          min_size=1, max_size=4),
       dtype=st.sampled_from([np.int32, np.int64]))
def test_find_markers_matches_naive_scan(tokens, marker, dtype):
    """On tiny vocabularies (overlapping and self-overlapping markers, e.g. [1, 1] in 1 1 1 1 1),
    find_markers == the naive left-to-right non-overlapping scan's start and end offsets."""
    got = find_markers(np.asarray(tokens, dtype=dtype), np.asarray(marker, dtype=np.int64))
    assert got.tolist() == naive_resets(tokens, marker)


def test_find_markers_hand_built():
    """Hand-computed cases: two occurrences, a self-overlapping chain, none, too short, empty."""
    m = np.array([7, 8, 9])
    assert find_markers(np.array([1, 7, 8, 9, 2, 7, 8, 9]), m).tolist() == [1, 4, 5, 8]
    assert find_markers(np.array([7, 8, 8, 9, 7, 9]), m).tolist() == []
    assert find_markers(np.array([7, 8]), m).tolist() == []
    assert find_markers(np.array([], dtype=np.int64), m).tolist() == []
    assert find_markers(np.array([1, 2, 3]), np.array([], dtype=np.int64)).tolist() == []
    # Marker [1, 1] in five 1s: occurrences at 0 and 2 (not 1, 3, which overlap the one taken).
    assert find_markers(np.ones(5, dtype=np.int64), np.array([1, 1])).tolist() == [0, 2, 2, 4]
    # Marker [1, 2, 1] in 1 2 1 2 1 2 1: 0 and 4 (2 overlaps 0; 4 does not).
    assert find_markers(np.array([1, 2, 1, 2, 1, 2, 1]), np.array([1, 2, 1])).tolist() == [
        0, 3, 4, 7]


def _split_markers(text: str) -> list[str]:
    return text.split(MARKER_TEXT)


def test_assemble_hand_built():
    """Hand-written expectations: a marker on both sides of each shared region, one (not two)
    between consecutive shared regions, none for unshared-only lists."""
    M = MARKER_TEXT
    assert assemble([]) == ""
    assert assemble([("a", False), ("b", False)]) == "ab"
    assert assemble([("a", True)]) == M + "a" + M
    assert assemble([("a", False), ("b", True), ("c", False)]) == "a" + M + "b" + M + "c"
    assert assemble([("a", True), ("b", True)]) == M + "a" + M + "b" + M
    assert assemble([("a", True), ("b", False), ("c", True)]) == M + "a" + M + "b" + M + "c" + M
    assert assemble([("a", True), ("", False), ("c", True)]) == M + "a" + M + M + "c" + M
    assert assemble(iter([("a", False), ("b", True)])) == "a" + M + "b" + M  # any iterable


@settings(max_examples=300, deadline=None)
@given(regions=st.lists(st.tuples(st.text(alphabet="ab \n.", max_size=6), st.booleans()),
                        max_size=8))
def test_assemble_marker_count_and_text(regions):
    """The number of markers is (#shared regions) + (#shared regions not preceded by a shared
    region), and deleting the markers gives back the concatenated texts, in order."""
    out = assemble(regions)
    shared = [s for _, s in regions]
    expected = sum(shared) + sum(1 for i, s in enumerate(shared) if s and (i == 0 or not shared[i - 1]))
    assert out.count(MARKER_BODY) == expected
    assert out.replace(MARKER_TEXT, "") == "".join(t for t, _ in regions)
    if not any(shared):
        assert out == "".join(t for t, _ in regions)
    # Each shared text sits directly between two markers.
    for text, s in regions:
        if s:
            assert MARKER_TEXT + text + MARKER_TEXT in out
