"""`irminsul bench`: the engine replayed per cache mode on a small chat workload."""

from __future__ import annotations

import json

import pytest
from fixtures.tiny_chat_model import build, workload

from irminsul.cli import main
from irminsul.traffic.logs import write_requests


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("bench")
    log = root / "chat.jsonl"
    write_requests(log, workload())
    out = root / "bench.json"
    assert main(["-q", "bench", "--model", str(build(root / "model", layers=2)),
                 "--workload", str(log), "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_modes_serve_what_they_should(report: dict) -> None:
    """off serves only exact prefixes; observer plans the same PIC hits as live but serves none,
    so its first-token distributions equal off's exactly; live serves them."""
    off, observer, live = report["off"], report["observer"], report["live"]
    assert report["requests"] == len(workload())
    assert off["pic_unique"] == 0 and not observer["pic_served"] and live["pic_served"]
    # live's exact prefix stops where an earlier turn's reused rows begin; the rest of the
    # same radix match is a derived prefix, counted with PIC: the totals agree.
    assert 0 < observer["pic_unique"] <= live["pic_unique"]
    assert off["exact_prefix"] == observer["exact_prefix"] >= live["exact_prefix"]
    assert live["total"] == pytest.approx(observer["total"])
    assert observer["kl_first_token"] == off["kl_first_token"]
    for mode in (off, observer, live):
        assert mode["total"] == pytest.approx(mode["exact_prefix"] + mode["pic_unique"])
        assert 0 < mode["ttft_p50_ms"] <= mode["ttft_p95_ms"]
        assert mode["kl_first_token"] >= 0
