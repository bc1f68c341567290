"""What the router predicts a backend serves, against the engine's own planner, hand-computed
values and a naive token-by-token reference; and the digest's wire format."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import xxhash

from irminsul.cache.cdc import chunk_boundaries
from irminsul.cache.planner import Planner
from irminsul.config import CacheConfig
from irminsul.router.digest import (
    BLOCK_TOKENS,
    Digest,
    DigestError,
    Load,
    decode_set,
    encode_set,
    public,
)
from irminsul.router.keys import request_keys
from irminsul.router.view import IndexView
from irminsul.server.index import prefix_set, read_planner

NAMESPACE = 0x1234_5678_9ABC_DEF0
# Without the probes the router does not model (S1 windows, chunk heads): what is left, the
# exact prefix, regions and chunks, the router must predict exactly.
CACHE = CacheConfig(s1=False, head_probe=False)


def _text(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(100, 8000, n).astype(np.int64)


def _prompt(*parts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Messages back to back, a reset at each one's start."""
    starts = np.cumsum([0] + [p.size for p in parts[:-1]])
    return np.concatenate(parts), starts


def _published(planner: Planner) -> IndexView:
    """A router's view of a backend whose planner this is (its digest, applied in full)."""
    trees, fingerprints, chunking = read_planner(planner)
    view = IndexView()
    view.apply(Digest("g", 1, True, chunking, Load(), set(prefix_set(trees)), set(),
                      set(fingerprints), set()), 0.0)
    return view


def _planned(planner: Planner, tokens: np.ndarray, resets: np.ndarray) -> int:
    """Tokens the planner serves from cache (exact prefix and hits) for a prompt."""
    plan = planner.plan(tokens, resets, namespace=NAMESPACE)
    return plan.tokens_of("prefix") + plan.tokens_of("hit")


def _serve(planner: Planner, tokens: np.ndarray, resets: np.ndarray) -> None:
    plan = planner.plan(tokens, resets, namespace=NAMESPACE)
    planner.commit(plan, np.arange(tokens.size, dtype=np.int64))


def test_a_moved_document_is_predicted_as_the_planner_serves_it() -> None:
    rng = np.random.default_rng(0)
    header, doc1, doc2 = _text(rng, 64), _text(rng, 300), _text(rng, 300)
    planner = Planner(CACHE)
    first, first_resets = _prompt(header, doc1, doc2, _text(rng, 50))
    _serve(planner, first, first_resets)
    view = _published(planner)
    # The same header, the documents swapped, a new question: the prefix is the header's one
    # block (64), then both documents are regions found whole (300 + 300): 664 by hand.
    moved, moved_resets = _prompt(header, doc2, doc1, _text(rng, 40))
    keys = request_keys(moved, moved_resets, NAMESPACE, {view.chunking})
    assert view.prefix_tokens(keys) == 64
    assert view.cached_tokens(keys) == 664 == _planned(planner, moved, moved_resets)
    assert view.cached_tokens(keys, content=False) == 64
    # Another tenant's namespace holds nothing.
    other = request_keys(moved, moved_resets, NAMESPACE + 1, {view.chunking})
    assert view.cached_tokens(other) == 0


def test_an_edited_document_is_predicted_chunk_by_chunk() -> None:
    rng = np.random.default_rng(1)
    planner = Planner(CACHE)
    doc = _text(rng, 900)
    first, first_resets = _prompt(_text(rng, 40), doc, _text(rng, 30))
    _serve(planner, first, first_resets)
    view = _published(planner)
    # Another header, the document with its end rewritten: not found whole, its chunks before
    # the edit are (content-defined, cut from the message start).
    edited = np.concatenate([doc[:700], _text(rng, 200)])
    second, second_resets = _prompt(_text(rng, 40), edited, _text(rng, 30))
    keys = request_keys(second, second_resets, NAMESPACE, {view.chunking})
    # A naive reference: the document's chunks compared as token tuples.
    bounds = chunk_boundaries(doc, mask_bits=CACHE.mask_bits, min_size=CACHE.min_chunk,
                              max_size=CACHE.max_chunk).tolist()
    seen = {tuple(doc[a:b]) for a, b in zip([0, *bounds], bounds)}
    cuts = chunk_boundaries(edited, mask_bits=CACHE.mask_bits, min_size=CACHE.min_chunk,
                            max_size=CACHE.max_chunk).tolist()
    naive = sum(b - a for a, b in zip([0, *cuts], cuts) if tuple(edited[a:b]) in seen)
    assert 0 < naive < 700
    assert view.cached_tokens(keys) == naive == _planned(planner, second, second_resets)


def test_the_prefix_is_known_to_a_block_and_chains() -> None:
    rng = np.random.default_rng(2)
    planner = Planner(CACHE)
    stored = _text(rng, 10 * BLOCK_TOKENS + 5)
    _serve(planner, stored, np.array([0]))
    view = _published(planner)
    # The published blocks are public(h_k) of the chain h_k = xxh64(block k as uint32,
    # seed h_{k-1}).
    h, expected = NAMESPACE, set()
    for k in range(10):
        h = xxhash.xxh64_intdigest(stored[k * 64:(k + 1) * 64].astype("<u4").tobytes(), h)
        expected.add(public(h))
    assert view.prefix == expected
    # A request sharing 200 tokens holds 3 whole blocks of them: 192.
    request = np.concatenate([stored[:200], _text(rng, 300)])
    keys = request_keys(request, np.array([0]), NAMESPACE, {view.chunking})
    assert view.prefix_tokens(keys) == 192
    # A block equal to a stored one at another place does not count: the chain differs.
    shifted = np.concatenate([_text(rng, 64), stored[64:640]])
    keys = request_keys(shifted, np.array([0]), NAMESPACE, {view.chunking})
    assert view.prefix_tokens(keys) == 0


def test_what_was_routed_counts_until_a_poll_after_it_ended() -> None:
    rng = np.random.default_rng(3)
    tokens, resets = _prompt(_text(rng, 64), _text(rng, 300))
    view = IndexView()
    chunking = _published(Planner(CACHE)).chunking
    view.apply(Digest("g", 1, True, chunking, Load(), set(), set(), set(), set()), 0.0)
    keys = request_keys(tokens, resets, NAMESPACE, {chunking})
    assert view.cached_tokens(keys) == 0
    ticket = view.route(keys)
    assert view.cached_tokens(keys) == tokens.size  # the prompt itself: all of it
    view.apply(Digest("g", 1, False, chunking, Load(), set(), set(), set(), set()), 5.0)
    assert view.cached_tokens(keys) == tokens.size  # still running: kept
    view.done(ticket, at=6.0)
    view.apply(Digest("g", 1, False, chunking, Load(), set(), set(), set(), set()), 5.5)
    assert view.routed == 1  # that poll was asked before the request ended
    view.apply(Digest("g", 1, False, chunking, Load(), set(), set(), set(), set()), 6.5)
    assert view.routed == 0 and view.cached_tokens(keys) == 0  # the index is the truth now
    failed = view.route(keys)
    view.done(failed, at=7.0, failed=True)
    assert view.routed == 0


def test_a_difference_applies_to_the_sets() -> None:
    chunking = _published(Planner(CACHE)).chunking
    view = IndexView()
    view.apply(Digest("g", 1, True, chunking, Load(), {1, 2}, set(), {10}, set()), 0.0)
    view.apply(Digest("g", 2, False, chunking, Load(), {3}, {1}, {11}, {10}), 0.0)
    assert (view.prefix, view.chunks, view.version) == ({2, 3}, {11}, 2)
    with pytest.raises(DigestError, match="generation"):
        view.apply(Digest("other", 3, False, chunking, Load(), set(), set(), set(), set()), 0.0)


def test_the_wire_format_round_trips_and_refuses_what_is_malformed() -> None:
    chunking = _published(Planner(CACHE)).chunking
    big = (1 << 64) - 1
    digest = Digest("g", 4, False, chunking, Load(2, 3, 0.25), {0, 5, big}, {7}, {big}, set())
    assert Digest.from_json(digest.to_json()) == digest
    assert decode_set(encode_set([3, 1, 2]), "x") == {1, 2, 3}
    body = digest.to_json()
    body["chunks"]["added"] = base64.b64encode(b"12345").decode()
    with pytest.raises(DigestError, match=r"chunks.added: 5 bytes"):
        Digest.from_json(body)
    body = digest.to_json()
    body["prefix"]["removed"] = "not base64!"
    with pytest.raises(DigestError, match=r"prefix.removed: not base64"):
        Digest.from_json(body)
    body = digest.to_json()
    del body["load"]
    with pytest.raises(DigestError, match="malformed index"):
        Digest.from_json(body)
    with pytest.raises(DigestError, match="format"):
        Digest.from_json({**digest.to_json(), "block_tokens": 32})


def test_a_request_that_requires_a_tool_call_is_predicted_as_the_server_plans_it() -> None:
    """A request with ``tool_choice: required`` is served with the call opened at the end of
    its prompt (the server's own preparation). The router must cut that prompt, not the one
    without the opening: else the last message's region (registered with the opening by the
    backend that served it) is never found, and the prompt's size is off."""
    import json
    from types import SimpleNamespace

    from irminsul.cache.cdc import request_namespace
    from irminsul.config import RouterConfig
    from irminsul.model.default import default_model_dir
    from irminsul.router.app import _analyse, build_router
    from irminsul.server.app import _prepare
    from irminsul.server.tool_calls import ToolSyntax

    routed = build_router(RouterConfig(backends=("http://127.0.0.1:1",)), default_model_dir())
    renderer = routed.state.router.renderer
    server = SimpleNamespace(model_name="m", renderer=renderer,
                             tool_syntax=ToolSyntax.learn(renderer))
    assert server.tool_syntax is not None
    words = "copper salt wool maps lanterns river ledger stone mill market".split()
    document = " ".join(np.random.default_rng(4).choice(words, 200))
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Find a fact",
                                               "parameters": {"type": "object"}}}]

    def body(system: str) -> bytes:
        return json.dumps({"model": "m", "tool_choice": "required", "tools": tools,
                           "messages": [{"role": "system", "content": system},
                                        {"role": "user", "content": document},
                                        {"role": "user", "content": "Which tool finds the mill?"}]
                           }).encode()

    def served(raw: bytes) -> tuple[np.ndarray, np.ndarray]:
        _, prompt = _prepare(server, raw, True)
        return np.asarray(prompt.tokens, dtype=np.int64), np.asarray(prompt.resets)

    planner, namespace = Planner(CACHE), request_namespace("m", None)  # the server's
    first, first_resets = served(body("You are agent A, who uses tools."))
    planner.commit(planner.plan(first, first_resets, namespace=namespace),
                   np.arange(first.size, dtype=np.int64))
    view = _published(planner)
    # Another agent's header: no exact prefix past the carve-out, so the planner's hits are
    # all the cache serves past it; the router's count must be those hits.
    raw = body("You are agent B, who answers from the document and calls tools.")
    tokens, resets = served(raw)
    plan = planner.plan(tokens, resets, namespace=namespace)
    assert plan.prefix.length < CACHE.carve_out and plan.tokens_of("hit") > 200
    keys = _analyse(routed.state.router, raw, True, None, {view.chunking}).keys
    assert keys is not None and keys.size == tokens.size
    assert view.prefix_tokens(keys) == 0
    assert view.cached_tokens(keys) == plan.tokens_of("hit")


@pytest.mark.parametrize(("field", "value"), [("kv_usage", "NaN"), ("kv_usage", "Infinity"),
                                              ("kv_usage", 1.5), ("running", -3)])
def test_a_load_no_backend_can_have_is_refused(field: str, value: object) -> None:
    """A load outside what an engine reports (a pool share in [0, 1], counts >= 0) is a
    malformed index (the backend is then marked down, as for any): taken as it is, a NaN share
    made every score compare false, and a choice whose first candidate had it raised on an
    empty max, failing every request; a negative count made a backend look less than idle."""
    chunking = _published(Planner(CACHE)).chunking
    body = Digest("g", 1, True, chunking, Load(), set(), set(), set(), set()).to_json()
    body["load"][field] = float(value) if isinstance(value, str) else value
    with pytest.raises(DigestError, match=f"load.{field}"):
        Digest.from_json(body)
