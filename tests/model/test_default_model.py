"""The embedded default model: shipped complete, rendered by our chat renderer as transformers
renders it, the same logits in both runtimes, and picked by the model commands when no --model is
given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from irminsul import cli
from irminsul.model import default_model_dir, load_model
from irminsul.traffic.render import ChatRenderer

MESSAGES = [
    {"role": "system", "content": "You are a helpful airline customer service agent."},
    {"role": "user", "content": "Hi, I want to change my flight to a later date."},
    {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": "c0", "type": "function",
         "function": {"name": "get_reservation", "arguments": '{"id": "ABC123"}'}}]},
    {"role": "tool", "tool_call_id": "c0", "content": '{"flights": ["HAT001"]}'},
]
TOOLS = [{"type": "function", "function": {
    "name": "get_reservation", "description": "Look up a reservation.",
    "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}}]


def test_shipped_files() -> None:
    """Weights, tokenizer, template, the model card with its figures and the corpus licenses;
    nothing else."""
    names = {p.name for p in default_model_dir().iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md", "licenses"} <= names
    # The training record stays in the repository (tools/default_model), out of the wheel.
    assert not names & {"train_config.json", "train_log.txt", "eval.json"}
    # Every corpus source's license text ships, and the card names each one it ships.
    licenses = {p.name for p in (default_model_dir() / "licenses").iterdir()}
    assert {"LICENSE.cpython-stdlib", "LICENSE.tau-bench", "LICENSE.mini-swe-agent"} <= licenses
    card = (default_model_dir() / "README.md").read_text("utf-8")
    assert all(f"licenses/{name}" in card for name in licenses)


def test_chat_template_renders_as_transformers_does() -> None:
    from transformers import AutoTokenizer

    rendered = ChatRenderer.from_dir(default_model_dir()).render(MESSAGES, TOOLS)
    reference = AutoTokenizer.from_pretrained(default_model_dir()).apply_chat_template(
        MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert rendered.tokens.tolist() == list(reference)
    assert len(rendered.spans) == len(MESSAGES)


def test_same_logits_as_transformers() -> None:
    from transformers import AutoModelForCausalLM

    ids = torch.from_numpy(ChatRenderer.from_dir(default_model_dir()).render(MESSAGES, TOOLS)
                           .tokens.astype("int64"))
    reference = AutoModelForCausalLM.from_pretrained(default_model_dir(),
                                                     dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    got = load_model(default_model_dir()).logits(ids)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    assert (got - expected).abs().max() <= 1e-4


def test_commands_default_to_the_embedded_model(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """bench and consistency run the default model on the default workload; serve is handed the
    default directory."""
    bench = tmp_path / "bench.json"
    assert cli.main(["-q", "bench", "--requests", "2", "--json", str(bench)]) == 0
    report = json.loads(bench.read_text())
    assert report["requests"] == 2 and Path(report["log"]).name == "agent_meta.jsonl"
    assert report["live"]["pic_unique"] > 0

    check = tmp_path / "consistency.json"
    assert cli.main(["-q", "consistency", "--requests", "2", "--tokens", "2",
                     "--json", str(check)]) == 0
    assert json.loads(check.read_text())["requests"] == 2

    import irminsul.server

    served = {}
    monkeypatch.setattr(irminsul.server, "serve", lambda model_dir, config, parallel: served.update(
        model_dir=model_dir, parallel=parallel))
    assert cli.main(["serve", "--device", "cpu"]) == 0
    assert served["model_dir"] == default_model_dir()
    assert served["parallel"].world_size == 1  # one process unless --tensor-parallel says more
