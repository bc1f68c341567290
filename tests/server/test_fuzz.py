"""Property-based fuzzing of every endpoint from the server's own OpenAPI schema (Schemathesis,
on Hypothesis): bodies that fit the schema and bodies that break it, each sent to the live
server. No input may get a 5xx, and every error must be OpenAI's JSON error shape. Bounded in
examples per endpoint, so the suite's time stays fixed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import schemathesis
from fixtures.openai_server import Server, config, running
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

EXAMPLES = 150  # per POST endpoint and generation mode (the GET ones have few distinct cases)



@pytest.fixture(scope="module")
def fuzz_server(model_dir) -> Iterator[Server]:
    # Short default replies: generated bodies that leave max_tokens out stay quick.
    with running(model_dir, config(default_max_tokens=4)) as served:
        yield served


def _operations(server: Server) -> list:
    loaded = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    return [result.ok() for result in loaded.get_all_operations()]


def _check(case, response) -> None:
    where = f"{case.method} {case.path} {case.body!r:.300}"
    assert response.status_code < 500, f"{where}: {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]  # JSON, in OpenAI's shape
        assert isinstance(error["message"], str) and error["message"], where
        assert {"type", "param", "code"} <= error.keys(), where


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_gets_a_server_error(fuzz_server: Server, mode: GenerationMode) -> None:
    """Every endpoint of the schema (the two POST routes' bodies come from the pydantic models
    the server validates with): ``positive`` cases fit the schema, ``negative`` ones break it
    (only routes with a body have anything to break)."""
    operations = _operations(fuzz_server)
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions",
                                              "/v1/models", "/health", "/metrics"}
    statuses: Counter[tuple[str, int]] = Counter()
    for operation in operations:
        if mode == GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case) -> None:
            response = case.call(timeout=60)
            statuses[case.path, response.status_code] += 1
            _check(case, response)

        fuzz()
    print(dict(statuses))
    for path in ("/v1/chat/completions", "/v1/completions"):  # the fuzzing reached both...
        assert sum(n for (p, status), n in statuses.items() if p == path) >= EXAMPLES // 2
        assert statuses[path, 400] > 0  # ...and was refused somewhere
        if mode == GenerationMode.POSITIVE:
            assert statuses[path, 200] > 0  # ...and served somewhere
    fuzz_server.check(timeout=60)  # slot accounting exact after all of it
    reply = fuzz_server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=3,
        temperature=0)  # greedy: the tiny model never picks a stop token so
    assert reply.usage.completion_tokens == 3
