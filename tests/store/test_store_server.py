"""Two servers of the embedded model on loopback, one Redis between them: a document a client
sent to A is served to another client of B from the store, and B's /metrics say so."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import httpx
import numpy as np
from fixtures.served_app import served
from openai import OpenAI

from irminsul.config import EngineConfig, ServerConfig, StoreConfig
from irminsul.model.default import default_model_dir
from irminsul.server import build_server
from irminsul.store import SharedStore

WORDS = ("the river keeps a ledger of every stone it moved north of the old mill where "
         "lanterns hang over a quiet market selling salt copper wool and maps").split()


@contextlib.contextmanager
def server(url: str) -> Iterator[tuple[OpenAI, str, SharedStore]]:
    # Without a correctness gate at start where the config has one: the store is under test.
    gate = {"gate": None} if "gate" in ServerConfig.__dataclass_fields__ else {}
    config = ServerConfig(model_name="default_model", dtype="float32", device="cpu",
                          engine=EngineConfig(mode="live", slots=4096),
                          store=StoreConfig(url=url, timeout_s=1.0), **gate)
    app, engine = build_server(default_model_dir(), config)
    store = engine.scheduler.engine.cache.store
    with served(app) as base:
        yield OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0), base, store
    store.close()


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_document_sent_to_a_is_served_by_b_from_the_store(redis_server) -> None:
    rng = np.random.default_rng(0)
    document = " ".join(rng.choice(WORDS, 500))
    ask = [{"role": "user", "content": document},
           {"role": "user", "content": "Which goods does the market sell?"}]
    with (server(redis_server.url) as (a, a_base, a_store),
          server(redis_server.url) as (b, b_base, _)):
        first = a.chat.completions.create(
            model="default_model", max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": "You are agent A."}, *ask])
        assert first.usage.prompt_tokens > 300
        assert a_store.flush()  # queued when A's prefill completed, before its first token
        reply = b.chat.completions.create(
            model="default_model", max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": "You are agent B, who answers briefly "
                                                    "and only from the document below."}, *ask])
        pic = reply.usage.model_extra["irminsul"]["pic_cached_tokens"]
        assert pic > 200
        assert metric(b_base, "irminsul:store_hit_tokens_total") >= pic
        assert metric(b_base, "irminsul:store_fetch_seconds_count") >= 1
        assert metric(a_base, "irminsul:store_published_chunks_total") >= 2
        assert 'irminsul:store_errors_total{kind="corrupt"} 0.0' in httpx.get(
            f"{b_base}/metrics").text
