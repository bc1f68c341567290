"""Review checks of bench and analyze figures against hand-computed expectations."""

from __future__ import annotations

import pytest
from fixtures.tiny_chat_model import build, documents, sentences

from irminsul.analysis.bench import bench
from irminsul.model import load_model
from irminsul.traffic.prompt import render_prompt
from irminsul.traffic.render import ChatRenderer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return build(tmp_path_factory.mktemp("review") / "model", layers=1)


def test_observer_would_be_pic_is_what_live_serves(model_dir) -> None:
    """Two prompts end with the same (shifted) last message: its region is a hit up to the
    prompt's last token. Live computes that last token (its logits start the generation), so
    observer's would-be PIC must not count it either: both modes report the same PIC tokens."""
    renderer = ChatRenderer.from_dir(model_dir)
    doc, question = documents(2)
    requests = [[{"role": "system", "content": " ".join(sentences(n, seed=n))},
                 {"role": "user", "content": doc}, {"role": "user", "content": question}]
                for n in (2, 5)]
    prompts = [render_prompt(renderer, m, session=str(i)) for i, m in enumerate(requests)]
    model = load_model(model_dir)
    report = bench(model, prompts, num_slots=sum(p.size for p in prompts) + 1,
                   modes=("observer", "live"))
    tokens = report["prompt_tokens"]
    live = round(report["live"]["pic_unique"] * tokens)
    observer = round(report["observer"]["pic_unique"] * tokens)
    assert live > 0
    assert observer == live


def test_bench_on_a_log_without_requests_is_an_error(model_dir, tmp_path, capsys) -> None:
    """A log with no usable request (here its one line is malformed), or --requests 0, leaves
    nothing to replay: an error naming why (exit status 2), not a ZeroDivisionError."""
    from irminsul.cli import main

    log = tmp_path / "bad.jsonl"
    log.write_text("not json\n")
    assert main(["-q", "bench", "--model", str(model_dir), "--workload", str(log)]) == 2
    assert "no requests" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["-q", "bench", "--model", str(model_dir), "--workload", str(log),
              "--requests", "0"])
    assert exit_.value.code == 2
