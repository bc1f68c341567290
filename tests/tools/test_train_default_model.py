"""The default model's pipeline on CPU: corpus + tokenizer from tiny synthetic sources, a few
training steps on the micro architecture, and the written directory loading with Irminsul's runtime
and with transformers to the same logits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "default_model"))

import build_corpus  # noqa: E402
import train_default_model  # noqa: E402
from chat_format import BOS, EOS  # noqa: E402

from irminsul.model import load_model  # noqa: E402
from irminsul.traffic.logs import write_requests  # noqa: E402
from irminsul.traffic.render import ChatRenderer  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "book_flight", "description": "Book a flight for the user.",
    "parameters": {"type": "object", "properties": {"flight": {"type": "string"}}}}}]


def _session(name: str, turns: int) -> list[dict]:
    """Calls of one session: each re-sends the growing history, as agent logs do."""
    messages = [{"role": "system", "content": f"You are airline agent {name}. Follow the policy."}]
    calls = []
    for turn in range(turns):
        messages = messages + [{"role": "user", "content": f"Please book flight HAT{turn:03d} "
                                                           f"from Boston to Denver, {name}."}]
        calls.append({"session": name, "call": turn, "messages": messages, "tools": TOOLS})
        messages = messages + [
            {"role": "assistant", "content": "Booking it now.", "tool_calls": [
                {"id": f"c{turn}", "type": "function",
                 "function": {"name": "book_flight", "arguments": {"flight": f"HAT{turn:03d}"}}}]},
            {"role": "tool", "tool_call_id": f"c{turn}", "name": "book_flight",
             "content": json.dumps({"status": "booked", "flight": f"HAT{turn:03d}"})}]
    return calls


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("sources")
    lib = root / "lib"
    (lib / "site-packages").mkdir(parents=True)
    for i in range(12):
        body = "".join(f"def function_{i}_{j}(value):\n    return value * {j} + {i}\n\n\n"
                       for j in range(40))
        (lib / f"module_{i}.py").write_text(f'"""Module {i}."""\n\n{body}')
    (lib / "site-packages" / "third_party.py").write_text("SECRET = 'not stdlib'\n")
    traces = root / "traces"
    traces.mkdir()
    calls = [c for s in range(8) for c in _session(f"agent{s}", 4)]
    write_requests(traces / build_corpus.LOGS["tau-bench"], calls)
    out = root / "train"
    manifest = build_corpus.build(out, lib, traces, vocab_size=400, max_tokens=10**6,
                                  val_fraction=0.2, seed=0)
    return out, manifest


def test_corpus(corpus) -> None:
    out, manifest = corpus
    sources = manifest["sources"]
    assert set(sources) == {"cpython-stdlib", "tau-bench"}  # a missing log is skipped
    assert sources["cpython-stdlib"]["documents"] == 12  # site-packages left out
    assert sources["tau-bench"]["documents"] == 8  # one document per session, not per call
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert train.size == manifest["train_tokens"] and val.size == manifest["val_tokens"] > 0
    renderer = ChatRenderer.from_dir(out / "tokenizer")
    bos, eos = (renderer.tokenizer.token_to_id(t) for t in (BOS, EOS))
    for tokens, starts in ((train, np.load(out / "train.starts.npy")),
                           (val, np.load(out / "val.starts.npy"))):
        assert (tokens[starts] == bos).all() and tokens[-1] == eos
    text = renderer.tokenizer.decode(train.tolist(), skip_special_tokens=False)
    assert "<|tool_call|>book_flight" in text and "<|tools|>### book_flight" in text
    assert "not stdlib" not in text


def test_train_writes_a_checkpoint_both_runtimes_read(corpus, tmp_path) -> None:
    data, _ = corpus
    out = tmp_path / "model"
    record = train_default_model.main([
        "--data", str(data), "--out", str(out), "--arch", "micro", "--steps", "3",
        "--seq-len", "32", "--batch", "2", "--warmup", "1", "--eval-windows", "2",
        "--log-every", "1", "--device", "cpu"])
    assert record["steps"] == 3 and np.isfinite(record["val_loss"])
    names = {p.name for p in out.iterdir()}
    assert names == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json", "train_config.json", "train_log.txt"}
    raw = json.loads((out / "config.json").read_text())
    assert "rope_parameters" not in raw and raw["rope_scaling"]["type"] == "yarn"
    assert raw["kv_lora_rank"] == 8 * raw["qk_rope_head_dim"] and not raw["tie_word_embeddings"]

    import transformers

    renderer = ChatRenderer.from_dir(out)
    ids = torch.from_numpy(renderer.render(_session("x", 2)[-1]["messages"], TOOLS).tokens)
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(ids.long()[None]).logits[0]
    got = load_model(out).logits(ids.long())
    assert (got - expected).abs().max() <= 1e-4


def test_a_schedule_resumed_from_its_state_trains_as_one_run(corpus, tmp_path) -> None:
    """Two calls sharing a --state file (2 steps, then the other 2) end with the weights of one
    uninterrupted 4-step run: the model, the optimizer's moments, the schedule's step and the
    data order all carry over."""
    data, _ = corpus
    common = ["--data", str(data), "--arch", "micro", "--steps", "4", "--seq-len", "32",
              "--batch", "2", "--warmup", "1", "--eval-windows", "2", "--bos-windows",
              "--device", "cpu"]
    whole = train_default_model.main([*common, "--out", str(tmp_path / "whole"),
                                      "--state", str(tmp_path / "whole.pt")])
    state = tmp_path / "split.pt"
    first = train_default_model.main([*common, "--out", str(tmp_path / "first"), "--state",
                                      str(state), "--call-steps", "2"])
    assert (first["steps"], first["calls"]) == (2, 1) and state.is_file()
    second = train_default_model.main([*common, "--out", str(tmp_path / "second"), "--state",
                                       str(state), "--call-steps", "2"])
    assert (second["steps"], second["calls"], second["tokens_seen"]) == (4, 2, whole["tokens_seen"])
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("whole", "second"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The first call's weights are not the end's: the second call trained.
    c = load_file(tmp_path / "first" / "model.safetensors")
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_single_bos_windows_keep_the_stream_without_interior_bos() -> None:
    """``--single-bos``: each window is BOS, then the token stream from its offset with every BOS
    left out (checked against a plain Python walk of the stream), wrapping at the end of the
    file; the default windows keep every packed document's BOS."""
    bos, seq_len = 1, 12
    docs = [[bos, *range(10, 10 + n), 2] for n in (3, 9, 1, 5, 7, 2, 4)]
    tokens = np.asarray([t for d in docs for t in d], dtype=np.uint16)
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    single = train_default_model.BosWindows(tokens, starts, seq_len, bos,
                                            np.random.default_rng(0), single_bos=True)
    plain = train_default_model.BosWindows(tokens, starts, seq_len, bos,
                                           np.random.default_rng(0))
    assert single.offsets.size > 2
    seen_interior = False
    for o in single.offsets.tolist():
        window = single._single_bos_window(o)
        expected, i = [], o + 1 if tokens[o] == bos else o
        while len(expected) < seq_len:
            if int(tokens[i % tokens.size]) != bos:
                expected.append(int(tokens[i % tokens.size]))
            i += 1
        assert window.tolist() == [bos, *expected]
        default = plain.take()
        seen_interior |= bool((default[1:] == bos).any())
    assert seen_interior  # the stream does pack several documents into a window
