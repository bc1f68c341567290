"""Tenant isolation of the published index (GET /irminsul/index) and of cache namespaces.

xxHash64 is not one-way: with the input known, its seed can be solved for (inputs under 32
bytes), and for a chosen input its output can be hit (preimages). The index publishes hashes of
salted tenants' content; these tests play a party that reads the index and knows no salt."""

from __future__ import annotations

import secrets

import numpy as np
import xxhash

from irminsul.cache.cdc import request_namespace
from irminsul.cache.planner import Planner
from irminsul.config import CacheConfig
from irminsul.router.digest import BLOCK_TOKENS
from irminsul.server.index import prefix_set, read_planner

M64 = (1 << 64) - 1
P1, P2 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F
P3, P4, P5 = 0x165667B19E3779F9, 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
MODEL = "default_model"


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & M64


def _rotr(x: int, r: int) -> int:
    return _rotl(x, 64 - r)


def _inv(a: int) -> int:
    return pow(a, -1, 1 << 64)


def _unshift(h: int, s: int) -> int:  # inverse of h ^= h >> s
    out = h
    for _ in range(64 // s + 1):
        out = h ^ (out >> s)
    return out


def _unavalanche(h: int) -> int:
    h = _unshift(h, 32)
    h = h * _inv(P3) & M64
    h = _unshift(h, 29)
    h = h * _inv(P2) & M64
    return _unshift(h, 33)


def _lane(k: int) -> int:
    return _rotl(k * P2 & M64, 31) * P1 & M64


def _steps(data: bytes) -> list:
    """The tail steps xxh64 applies to an input under 32 bytes, in order."""
    out, at = [], 0
    while len(data) - at >= 8:
        out.append(("8", int.from_bytes(data[at:at + 8], "little")))
        at += 8
    if len(data) - at >= 4:
        out.append(("4", int.from_bytes(data[at:at + 4], "little")))
        at += 4
    out += [("1", b) for b in data[at:]]
    return out


def recover_seed(data: bytes, digest: int) -> int:
    """The seed under which xxh64(data) is ``digest`` (``data`` under 32 bytes)."""
    assert len(data) < 32
    h = _unavalanche(digest)
    for kind, v in reversed(_steps(data)):
        if kind == "8":
            h = _rotr((h - P4) * _inv(P1) & M64, 27) ^ _lane(v)
        elif kind == "4":
            h = _rotr((h - P3) * _inv(P2) & M64, 23) ^ (v * P1 & M64)
        else:
            h = _rotr(h * _inv(P1) & M64, 11) ^ (v * P5 & M64)
    return (h - P5 - len(data)) & M64


def forge_salt(model: str, target: int) -> str | None:
    """A salt whose ``request_namespace(model, salt)`` is ``target`` were the namespace the
    xxh64 of ``model + "\\x1f" + salt`` (a preimage: the last 8 bytes are solved for)."""
    head = (model + "\x1f").encode()
    free = (-len(head)) % 8  # ASCII bytes to fill the lane, then one 8-byte lane, solved
    length = len(head) + free + 8
    assert length < 32
    for n in range(1 << 16):
        prefix = head + bytes((n >> 7 * i) & 0x7F for i in range(free))
        h = (P5 + length) & M64
        for _, v in _steps(prefix):
            h = (_rotl(h ^ _lane(v), 27) * P1 + P4) & M64
        want = _rotr((_unavalanche(target) - P4) * _inv(P1) & M64, 27) ^ h
        lane = _rotr(want * _inv(P1) & M64, 31) * _inv(P2) & M64
        tail = lane.to_bytes(8, "little")
        try:
            return (prefix + tail)[len(head):].decode()
        except UnicodeDecodeError:
            continue
    return None


def _victim(planner: Planner, namespace: int) -> tuple[np.ndarray, np.ndarray]:
    """A salted tenant's prompt committed: a system prompt, a document, and a short message
    (a region of 6 tokens, whose content a party guesses: a role token, "ok", a role token)."""
    rng = np.random.default_rng(7)
    system = rng.integers(1000, 2000, 40)
    document = rng.integers(2000, 3000, 3 * BLOCK_TOKENS)
    short = np.array([5, 77, 78, 6, 9, 10])
    tokens = np.concatenate([system, document, short]).astype(np.int64)
    resets = np.array([40, 40 + document.size])
    plan = planner.plan(tokens, resets, namespace=namespace)
    planner.commit(plan, np.arange(tokens.size, dtype=np.int64))
    return tokens, short


def _published(planner: Planner) -> tuple[set[int], set[int]]:
    trees, fingerprints, _ = read_planner(planner)
    return set(prefix_set(trees)), set(fingerprints)


def test_index_does_not_give_away_a_salted_namespace() -> None:
    """From the published chunks and a guessed short message, a party without the salt solves
    for the tenant's namespace (the seed of every hash of its content), then for a salt of its
    own that names that namespace: it is served the tenant's KV."""
    salt = secrets.token_hex(16)
    victim = request_namespace(MODEL, salt)
    planner = Planner(CacheConfig(), pic=True)
    tokens, short = _victim(planner, victim)
    _, chunks = _published(planner)
    guess = short.astype("<u4").tobytes()
    candidates = {recover_seed(guess, fp) for fp in chunks}
    assert victim not in candidates, "the index gives away the tenant's namespace"


def test_a_namespace_does_not_give_away_a_salt() -> None:
    """Whoever learns a tenant's namespace (a store key, a log line) must not be able to make a
    salt that names it."""
    salt = secrets.token_hex(16)
    victim = request_namespace(MODEL, salt)
    forged = forge_salt(MODEL, victim)
    assert forged is None or request_namespace(MODEL, forged) != victim, (
        f"salt {forged!r} names the tenant's namespace")
    planner = Planner(CacheConfig(), pic=True)
    tokens, _ = _victim(planner, victim)
    if forged is not None:
        plan = planner.plan(tokens, namespace=request_namespace(MODEL, forged))
        assert plan.prefix.length == 0


def test_index_prefix_chain_cannot_be_extended_without_the_salt() -> None:
    """The published prefix hashes are the chain itself: h_k seeds h_{k+1}, so from any
    published hash a party tests a guessed next block against the set, no salt needed."""
    salt = secrets.token_hex(16)
    planner = Planner(CacheConfig(), pic=True)
    tokens, _ = _victim(planner, request_namespace(MODEL, salt))
    prefix, _ = _published(planner)
    guess = tokens[BLOCK_TOKENS:2 * BLOCK_TOKENS].astype("<u4").tobytes()  # the document's
    found = [h for h in prefix if xxhash.xxh64_intdigest(guess, h) in prefix]
    assert not found, "a guessed block of a salted tenant's prompt is found in the index"


def test_salts_do_not_collide_across_model_names() -> None:
    """Parts joined by a separator a salt may contain: ("m", "a\\x1fb") == ("m\\x1fa", "b")."""
    assert request_namespace("m", "a\x1fb") != request_namespace("m\x1fa", "b")


def test_index_token_keeps_the_index_from_other_readers(model_dir) -> None:
    """Unsalted requests share the model name's namespace, which anyone can compute: whoever
    reads the index tests whether a guessed unsalted prompt is cached. With an index token
    only its bearer (the routers) reads the index."""
    import httpx
    from fixtures.openai_server import config, running

    from irminsul.router.digest import decode_set, prefix_hashes

    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(10, 200, 3 * BLOCK_TOKENS)]
    with running(model_dir, config(index_token="s3cret")) as served:
        answer = httpx.post(f"{served.url}/v1/completions", timeout=60, json={
            "model": served.model, "prompt": prompt, "max_tokens": 1})
        assert answer.status_code == 200, answer.text
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            refused = httpx.get(f"{served.url}/irminsul/index", headers=headers)
            assert refused.status_code == 401, refused.text
        index = httpx.get(f"{served.url}/irminsul/index",
                          headers={"Authorization": "Bearer s3cret"})
        assert index.status_code == 200
        held = decode_set(index.json()["prefix"]["added"], "prefix")
        guess = prefix_hashes(np.array(prompt), request_namespace(served.model, None))
        assert set(guess) <= held  # what the token keeps from other readers
