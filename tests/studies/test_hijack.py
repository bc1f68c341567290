"""``irminsul study hijack`` on a tiny chat model, its figures against references outside the
engine: transformers' DeepseekV2 for every full recomputation (the clean prompt, the prompt with
the preamble in it, the target reply's log-probabilities), and a hand-assembled cache for what
PIC serves (the document's rows from a plain forward of the attacker's prompt, k_r rotated by δ,
the rest of the victim's prompt computed after them by the model's plain forward)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fixtures.tiny_chat_model import random_model, write_tokenizer

from irminsul.cli import main
from irminsul.engine.audit import kl_per_step
from irminsul.model import load_model
from irminsul.studies.hijack import Case, HijackSettings, documents, make_case
from irminsul.traffic.render import ChatRenderer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DOCUMENTS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """The tiny model (ours and transformers'), its renderer, and the study's JSON report from
    the command line with one continuation token (so each KL is the first token's)."""
    directory = tmp_path_factory.mktemp("tiny_chat_hijack")
    size = write_tokenizer(directory)
    reference = random_model(size, layers=2)
    reference.save_pretrained(directory)
    out = tmp_path_factory.mktemp("hijack_out")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["-q", "study", "hijack", "--model", str(directory), "--out", str(out),
                     "--documents", str(DOCUMENTS), "--tokens", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((out / "hijack.json").read_text("utf-8"))
    return reference, load_model(directory), ChatRenderer.from_dir(directory), report, out


def cases(renderer: ChatRenderer) -> list[Case]:
    settings = HijackSettings(documents=DOCUMENTS)
    return [make_case(renderer, text, i) for i, text in enumerate(documents(renderer, settings))]


def reference_logits(reference, tokens: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return reference(input_ids=torch.as_tensor(tokens.astype(np.int64))[None]).logits[0]


def log_p(logits: torch.Tensor, target: np.ndarray) -> float:
    """Mean log-probability of ``target`` given the logits of the rows before each token."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    return float(lp[torch.arange(len(target)), torch.as_tensor(target.astype(np.int64))].mean())


def served_by_hand(model, case: Case) -> torch.Tensor:
    """The victim's first-token logits with the document's rows those of the attacker's prompt
    (k_r rotated by δ) and everything else computed in the victim's prompt."""
    rank = model.config.kv_lora_rank
    source, target = case.document(case.attacker), case.document(case.victim)
    victim = torch.as_tensor(case.victim.tokens.astype(np.int64))
    attacker = torch.as_tensor(case.attacker.tokens.astype(np.int64))
    rows = model.forward(attacker, torch.arange(len(attacker))).latents
    delta = target.start - source.start
    document = [torch.cat([r[source, :rank], model.rotary.rotate(r[source, rank:], delta)], -1)
                for r in rows]
    before = model.forward(victim[:target.start], torch.arange(target.start)).latents
    context = [torch.cat([a, b]) for a, b in zip(before, document)]
    rest = torch.arange(target.stop, len(victim))
    return model.forward(victim[target.stop:], rest, context).logits[-1]


def test_writes_png_and_json(run) -> None:
    *_, report, out = run
    assert (out / "hijack.png").read_bytes().startswith(PNG_MAGIC)
    assert {"study", "model", "settings", "namespaces", "references", "conditions", "deviation",
            "cases", "seconds"} <= report.keys()
    assert set(report["conditions"]) == {"benign", "hijack", "salted", "epic_k16", "epic_k32",
                                         "cacheblend_r5", "cacheblend_r10", "cacheblend_r15"}
    # The tenants' namespaces differ from each other and from the unsalted one.
    assert len(set(report["namespaces"].values())) == 3
    assert len(report["cases"]) == DOCUMENTS


def test_references_are_transformers_full_recomputation(run) -> None:
    """The preamble's own effect and the target reply's log-probabilities, as transformers
    computes them from the same weights."""
    reference, _, renderer, report, _ = run
    for case, row in zip(cases(renderer), report["cases"]):
        clean = reference_logits(reference, case.victim.tokens)[-1:]
        attacked = reference_logits(reference, case.attacked.tokens)[-1:]
        want = float(kl_per_step(clean, attacked)[0])
        assert want > 1e-4  # the preamble changes the next token's distribution
        assert row["kl_clean_attacked"] == pytest.approx(want, rel=1e-3, abs=1e-7)
        for prompt, key in ((case.victim, "target_logprob_clean"),
                            (case.attacked, "target_logprob_attacked")):
            ids = np.concatenate([prompt.tokens, case.target])
            logits = reference_logits(reference, ids)[prompt.size - 1:-1]
            assert row[key] == pytest.approx(log_p(logits, case.target), rel=1e-4, abs=1e-5)


def test_served_rows_are_the_attackers_and_salt_isolates(run) -> None:
    """Shared namespace: the whole document is served from the attacker's registration, and the
    KL from the clean prompt is that of the hand-assembled cache; each repair reuses what its
    rule leaves; under different cache_salts nothing is reused and the output is the clean
    prompt's."""
    reference, model, renderer, report, _ = run
    for case, row in zip(cases(renderer), report["cases"]):
        document = case.document(case.victim)
        size = document.stop - document.start
        assert row["hijack"]["pic_tokens"] == size == row["document_tokens"]
        clean = reference_logits(reference, case.victim.tokens)[-1:]
        want = float(kl_per_step(clean, served_by_hand(model, case)[None])[0])
        assert want > 1e-6  # the preamble reached the victim through the rows
        assert row["hijack"]["kl_clean"] == pytest.approx(want, rel=1e-3, abs=1e-7)
        assert row["salted"]["pic_tokens"] == 0 and row["salted"]["kl_clean"] < 1e-9
        for k in (16, 32):
            assert row[f"epic_k{k}"]["pic_tokens"] == size - k
        for r in (5, 10, 15):
            assert row[f"cacheblend_r{r}"]["pic_tokens"] == size - int(r / 100 * size)


def test_deviation_is_zero_at_layer_0_only(run) -> None:
    """Layer 0's rows are the token's own wherever it sits; from layer 1 on the context shows."""
    *_, report, _ = run
    for context in ("hijack", "benign"):
        layers = report["deviation"][context]
        assert max(v for v in layers[0] if v is not None) < 1e-5
        assert min(v for v in layers[1] if v is not None) > 1e-4
