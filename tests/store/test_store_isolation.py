"""Values of another tenant or another model are never served: their keys are not the ones a
lookup asks for, and even the very same chunk's value copied under such a key (a bug, a hostile
writer: intact, same tokens, same rows) is refused by its header and never enters the pool."""

from __future__ import annotations

import numpy as np
import torch
from store_prompts import documents, publish

from irminsul.cache.cdc import Fingerprinter, namespace_seed
from irminsul.engine import Engine
from irminsul.model import load_model
from irminsul.model.default import default_model_dir
from irminsul.store.keys import key, model_identity

TENANT_A = namespace_seed("default_model", "tenant-a")
TENANT_B = namespace_seed("default_model", "tenant-b")


def forge(server, source: Engine, victim: Engine, prompt: np.ndarray, resets: list[int],  # noqa: ANN001
          namespaces: tuple[int, int]) -> int:
    """Copy ``source``'s values, published under ``namespaces[0]``, to the keys ``victim`` asks
    for when it serves ``prompt`` under ``namespaces[1]``, chunk by chunk of the same tokens.
    Returns how many were copied."""
    client, store = server.client(), victim.cache.store
    plan = victim.cache.planner.plan(prompt, resets, namespace=namespaces[1])
    fingerprint = Fingerprinter(prompt, namespaces[0])
    copied = 0
    for chunk in store.wanted(plan):
        value = client.get(key(source.cache.store.shape.model_id, namespaces[0],
                               fingerprint(chunk.start, chunk.end)))
        if value is not None:
            client.set(key(store.shape.model_id, namespaces[1], chunk.fingerprint), value)
            copied += 1
    return copied


def test_another_tenants_values_are_never_served(redis_server, engines) -> None:
    source, rs, target, rt = documents(40)
    a, b = engines(redis_server.url), engines(redis_server.url)
    publish(a, source, rs, namespace=TENANT_A)
    _, expected = engines().prefill(target, rt, namespace=TENANT_B)
    # Tenant B's lookups do not address tenant A's values.
    keys = set(redis_server.client().keys("*"))
    seq, logits = b.prefill(target, rt, namespace=TENANT_B)
    assert seq.stats.pic_tokens == 0 and torch.equal(logits, expected)
    assert b.cache.store.stats.hit_tokens == 0 and sum(b.cache.store.stats.errors.values()) == 0
    b.finish(seq)
    assert b.cache.store.flush()
    # The same chunks' values copied under tenant B's keys: refused, every one.
    for k in set(redis_server.client().keys("*")) - keys:
        redis_server.client().delete(k)  # what B published itself meanwhile
    c = engines(redis_server.url)
    copied = forge(redis_server, a, c, target, rt, (TENANT_A, TENANT_B))
    assert copied >= 3
    seq, logits = c.prefill(target, rt, namespace=TENANT_B)
    assert seq.stats.pic_tokens == 0 and torch.equal(logits, expected)
    assert c.cache.store.stats.hit_tokens == 0
    assert c.cache.store.stats.errors["mismatch"] == copied
    c.finish(seq)
    c.check()
    # Tenant A itself is served.
    seq, _ = engines(redis_server.url).prefill(target, rt, namespace=TENANT_A)
    assert seq.stats.pic_tokens >= 360


def test_another_models_values_are_never_served(redis_server, engines) -> None:
    source, rs, target, rt = documents(41)
    a = engines(redis_server.url)
    other = engines(redis_server.url, model_id="another-checkpoint")
    publish(a, source, rs)
    assert other.cache.store.shape.model_id != a.cache.store.shape.model_id
    copied = forge(redis_server, a, other, target, rt, (0, 0))
    assert copied >= 3
    seq, logits = other.prefill(target, rt)
    _, expected = engines().prefill(target, rt)
    assert seq.stats.pic_tokens == 0 and torch.equal(logits, expected)
    assert other.cache.store.stats.errors["mismatch"] == copied
    other.check()


def test_model_identity_follows_weights_and_kv_dtype(model) -> None:
    same = load_model(default_model_dir())
    assert model_identity(same, torch.float32) == model_identity(model, torch.float32)
    assert model_identity(model, torch.bfloat16) != model_identity(model, torch.float32)
    with torch.no_grad():
        next(iter(same.parameters())).mul_(1.001)  # a "fine-tune"
    assert model_identity(same, torch.float32) != model_identity(model, torch.float32)
